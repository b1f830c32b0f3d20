"""Training code for the embedded default model, kept in the package so the model can be rebuilt anywhere."""

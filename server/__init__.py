"""text-generation-server: a gRPC server for large language models."""

__version__ = "0.1.0"

# The short id of the model shipped in server/assets/, accepted wherever a model folder is.
EMBEDDED_MODEL_ID = "tiny-pycoder"

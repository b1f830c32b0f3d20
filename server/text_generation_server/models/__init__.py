"""The architectures: decoder.py (the shared decoder), families/ (one module per native
family), transformers_impl.py (the fallback over transformers' modeling code), registry.py
(which of them serves a checkpoint, and its config), loader.py (get_model: a checkpoint to a
ready CausalLM).
"""

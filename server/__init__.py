"""text-generation-server: a gRPC server for large language models."""

__version__ = "0.1.0"

"""Quantized-linear kernels. Importing the package registers every kernel module in the
order kernels/registry.py gives, so priority never depends on which module a caller
happens to import first."""

from text_generation_server.kernels import registry  # noqa: F401

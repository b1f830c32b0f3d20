"""Imports every kernel module so each registers itself in base.KERNELS, in priority order.

Order matters: within a device list, earlier registration means preferred. The CUDA/Triton
kernels will be imported here too; a module that cannot load on this machine (no Triton)
must register nothing rather than fail the import.
"""

from text_generation_server.kernels import cpu  # noqa: F401

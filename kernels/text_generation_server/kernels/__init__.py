"""Tensor code with no checkpoint or model knowledge: quantized-linear kernels (kernels/table.py
ranks them per device, kernels/select.py chooses and builds them), CPU native and Triton kernels,
paged attention, scratch sizing. This package imports nothing of the rest of the project, and its
__init__ imports nothing at all: importing one kernel module loads only what that module needs."""

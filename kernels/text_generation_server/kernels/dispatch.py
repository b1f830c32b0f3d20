"""A linear that two kernels can run, holding both builds and picking one per forward.

Warmup makes one where a device's table pairs two kernels (kernels/table.py, TIMED_PAIRS) and the
second measured faster than the first at some decode batch size (kernels/select.py,
`tune_kernels`). The rule is kernels/phase.py's, with kernels for variants:
- a prefill forward takes the first kernel (the one the table ranks first), whatever its row
  count, so a prompt's bits never depend on how it is chunked;
- a decode forward takes the kernel measured fastest for its row bucket (`measured`), else the
  first. Warmup captures the CUDA graphs after the choice, so a replay runs the kernel measured
  fastest at its batch size.
Each build is a submodule (`builds`, in table order), so `.to()`, memory counts and the scratch
space see it; `drop_unused` lets go of a build no bucket takes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from text_generation_server.kernels.phase import choose_variant, run_rows


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes of the tensors `module` holds (parameters and buffers, each storage counted once)."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class KernelDispatch(torch.nn.Module):
    """x [..., K] -> [..., N] through one of `builds` (kernel name -> built module, table order
    first), by phase and decode row bucket (phase.RowVariantLayer, whose variants are kernels)."""

    # Its row-bucket choices are kernels, kept in the preferences apart from a kernel's own
    # variants (kernels/select.py, Preferences), which its builds may still have.
    preference_scope = "kernel"

    def __init__(self, builds: Mapping[str, torch.nn.Module], measured: Mapping[int, str] | None = None):
        super().__init__()
        if not builds:
            raise ValueError("a kernel dispatch needs at least one build")
        self.builds = torch.nn.ModuleDict(dict(builds))
        self.measured: dict[int, str] = dict(measured or {})  # row bucket -> kernel name
        first = next(iter(builds.values()))
        for name in ("linear_spec", "computes", "in_features", "out_features"):
            if hasattr(first, name):
                setattr(self, name, getattr(first, name))

    @property
    def kernel_name(self) -> str:
        """The kernels it runs, the prompts' first ("triton-gemm+tinygemm"), as Info.kernels lists them."""
        return "+".join(self.builds)

    def variants(self, rows: int) -> tuple[str, ...]:
        return tuple(self.builds)

    def prompt_variant(self) -> str:
        return next(iter(self.builds))

    def static_variant(self, rows: int) -> str:
        return next(iter(self.builds))

    def run(self, x: torch.Tensor, variant: str) -> torch.Tensor:
        return self.builds[variant](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        k = x.shape[-1]
        y = run_rows(self, x.reshape(-1, k))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def chosen(self, buckets: list[int]) -> dict[int, str]:
        """The kernel each decode row bucket runs."""
        return {b: choose_variant(self, b) for b in buckets}

    def drop_unused(self) -> list[str]:
        """Lets go of every build that neither prompts nor a measured bucket take; returns their names."""
        keep = {self.prompt_variant(), *self.measured.values()}
        dropped = [name for name in self.builds if name not in keep]
        for name in dropped:
            del self.builds[name]
        return dropped

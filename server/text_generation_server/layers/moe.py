"""Sparse mixture-of-experts blocks: a router picks k experts per token, each a gated MLP.

Routing follows transformers' modeling code per family (read there, not copied):
- Mixtral: softmax over every expert in float32, top-k, renormalised; the weights stay float32.
- Qwen2-MoE / Qwen3-MoE: the same softmax and top-k, renormalised only with `norm_topk_prob`,
  the weights cast back to the activation dtype; Qwen2-MoE adds a shared expert scaled by
  sigmoid(shared_expert_gate(x)).
- gpt-oss: top-k of the biased router logits, a softmax over those k only; experts carry biases
  and a clamped SwiGLU ((u + 1) * g * sigmoid(alpha * g)).
- DeepSeek-V2 ("softmax_group"): float32 logits of a float32 gate, softmax over every expert;
  greedy top-k, or group-limited (each group scored by its best expert, the best topk_group
  groups kept, the others' scores zeroed); never renormalised; times routed_scaling_factor.
- DeepSeek-V3 ("sigmoid_group"): float32 sigmoid scores; the choice adds e_score_correction_bias
  and is group-limited (a group scored by the sum of its two best, the others' experts set to
  -inf), but the weights are the unbiased scores, renormalised with norm_topk_prob (+1e-20),
  then times routed_scaling_factor. Both keep the weights float32 (transformers' routers do).
Each routing weight multiplies the whole expert output, bias included.

Experts are loaded one by one through the loader factory (any quantized format that loads a
linear loads an expert), sharded across ranks along the expert intermediate dimension (gate/up
column-parallel, down row-parallel): every rank holds every expert, so routing is local and one
all-reduce per block sums the partial outputs. Unquantized experts are stacked per layer
([E, 2I, H] and [E, H, I]) so the fused CUDA kernel can read them; the per-expert linears are
views into those stacks, no second copy.

CPU execution groups the (token, slot) pairs by expert with one stable sort, then runs one
gate_up and one down GEMM per expert that any token chose: no Python loop over tokens.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from loguru import logger
from text_generation_server.kernels.dense import DenseLinear
from text_generation_server.layers.mlp import GatedMLP, activation
from text_generation_server.layers.tensor_parallel import (
    TensorParallelColumnLinear,
    TensorParallelRowLinear,
)
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights

# gpt-oss's clamped SwiGLU; transformers' GptOssConfig defaults (swiglu_alpha, swiglu_limit).
SWIGLU_OAI = "swiglu_oai"


@dataclass(frozen=True)
class RouterOptions:
    """How a family turns router logits into k (expert, weight) pairs per token.

    scoring: "softmax" (softmax over all experts, then top-k: Mixtral, Qwen-MoE),
    "topk_softmax" (top-k of the logits, then a softmax over those k: gpt-oss), or DeepSeek's
    grouped "softmax_group" (V2) and "sigmoid_group" (V3), whose logits are float32 from a
    float32 gate weight (module docstring).
    """

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    float32_weights: bool = False  # Mixtral keeps its routing weights in float32
    bias: bool = False
    # DeepSeek: experts in n_group equal groups, the choice limited to the best topk_group groups.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # V3's e_score_correction_bias (added for the choice only)


GROUPED_SCORINGS = ("softmax_group", "sigmoid_group")


class Router(torch.nn.Module):
    """The replicated gate: hidden [T, H] -> (weights [T, k], expert ids [T, k] int64)."""

    def __init__(self, opts: RouterOptions, weight: torch.Tensor, bias: torch.Tensor | None,
                 correction: torch.Tensor | None = None):
        super().__init__()
        if opts.scoring not in ("softmax", "topk_softmax", *GROUPED_SCORINGS):
            raise ValueError(f"unknown router scoring '{opts.scoring}'")
        if not 0 < opts.top_k <= opts.num_experts:
            raise CheckpointError(f"config.json: num_experts_per_tok ({opts.top_k}) must be between 1 and the "
                                  f"{opts.num_experts} experts")
        if opts.scoring in GROUPED_SCORINGS:
            if opts.n_group < 1 or opts.num_experts % opts.n_group:
                raise CheckpointError(f"config.json: n_group ({opts.n_group}) must divide the {opts.num_experts} "
                                      "routed experts")
            if not 0 < opts.topk_group <= opts.n_group:
                raise CheckpointError(f"config.json: topk_group ({opts.topk_group}) must be between 1 and n_group "
                                      f"({opts.n_group})")
            per_group = opts.num_experts // opts.n_group
            if opts.scoring == "sigmoid_group" and opts.topk_group < opts.n_group and per_group < 2:
                raise CheckpointError(f"config.json: {per_group} expert per group; DeepSeek-V3 scores a group by "
                                      "its two best experts")
            if opts.top_k > opts.topk_group * per_group:
                raise CheckpointError(f"config.json: num_experts_per_tok ({opts.top_k}) exceeds the "
                                      f"{opts.topk_group * per_group} experts of the topk_group groups")
        self.opts = opts
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.correction = None if correction is None else torch.nn.Parameter(correction, requires_grad=False)

    @classmethod
    def load(cls, weights: Weights, prefix: str, opts: RouterOptions, hidden: int) -> Router:
        # DeepSeek's routers compute in float32 from a float32 gate (transformers keeps gate.weight
        # and e_score_correction_bias in float32 whatever the model's dtype).
        keep32 = opts.scoring in GROUPED_SCORINGS
        weight = weights.get_tensor(f"{prefix}.weight", to_dtype=not keep32)
        if list(weight.shape) != [opts.num_experts, hidden]:
            raise CheckpointError(f"'{prefix}.weight' has shape {list(weight.shape)}, expected "
                                  f"[{opts.num_experts}, {hidden}] (experts x hidden) (in {weights.files_of(prefix)})")
        bias = weights.get_tensor(f"{prefix}.bias") if opts.bias else None
        correction = None
        if opts.correction_bias:
            name = f"{prefix}.e_score_correction_bias"
            correction = weights.get_tensor(name, to_dtype=False).float()
            if list(correction.shape) != [opts.num_experts]:
                raise CheckpointError(f"'{name}' has shape {list(correction.shape)}, expected [{opts.num_experts}] "
                                      f"(in {weights.files_of(name)})")
        return cls(opts, weight.float() if keep32 else weight, bias, correction)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.opts.scoring in GROUPED_SCORINGS:
            return self._grouped(x)
        logits = F.linear(x, self.weight, self.bias)
        opts = self.opts
        if opts.scoring == "topk_softmax":
            top, ids = torch.topk(logits, opts.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, opts.top_k, dim=-1)
        if opts.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top if opts.float32_weights else top.to(logits.dtype)), ids

    def _grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's routing (module docstring); weights [T, k] float32."""
        opts = self.opts
        logits = F.linear(x.float(), self.weight)  # [T, E] float32
        sigmoid = opts.scoring == "sigmoid_group"
        scores = logits.sigmoid() if sigmoid else torch.softmax(logits, dim=-1)
        choice = scores + self.correction if self.correction is not None else scores
        if opts.topk_group < opts.n_group:  # keeping every group is a no-op: skipped
            grouped = choice.view(-1, opts.n_group, opts.num_experts // opts.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1) if sigmoid else grouped.amax(dim=-1)
            kept = torch.topk(group_scores, opts.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            # V2 zeroes the other groups' scores, V3 sets them to -inf (a zero could still be chosen).
            choice = grouped.masked_fill(~keep[..., None], float("-inf") if sigmoid else 0.0).flatten(1)
        ids = torch.topk(choice, opts.top_k, dim=-1, sorted=False).indices
        top = scores.gather(1, ids)
        if opts.renormalize:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return top * opts.routed_scaling_factor, ids


@dataclass(frozen=True)
class ExpertOptions:
    """One layer's routed experts. `names(e)` gives expert e's (gate, up, down) prefixes."""

    num_experts: int
    hidden: int
    intermediate: int
    names: Callable[[int], tuple[str, str, str]]
    act: str = "silu"
    bias: bool = False
    top_k: int = 1  # experts per token (sizes the fused kernel's scratch)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


# transformers' activation names -> the fused kernel's (gated activations it implements).
_FUSED_ACTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh"}


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU, in transformers' order of operations."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _stack_dense(linears: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The experts' weights (and biases) as one stacked tensor, re-pointing each expert's
    parameters at its row of the stack; None when some expert is not a dense linear."""
    if not all(isinstance(m, DenseLinear) for m in linears):
        return None
    stacked = torch.stack([m.weight.data for m in linears])
    biases = None
    if all(m.bias is not None for m in linears):
        biases = torch.stack([m.bias.data for m in linears])
    for e, m in enumerate(linears):
        m.weight = torch.nn.Parameter(stacked[e], requires_grad=False)
        if biases is not None:
            m.bias = torch.nn.Parameter(biases[e], requires_grad=False)
    return stacked, biases


# `quantize` builds layers to calibrate them through the per-expert linears' hooks: there the
# fused kernel (which holds only stacked weights) must not be chosen.
_GROUPED_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("moe_grouped_only", default=False)
_LOGGED: set[str] = set()
# torch's grouped GEMM (a CPU kernel since torch 2.9); None where this torch has none.
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@contextmanager
def grouped_experts_only() -> Iterator[None]:
    """Experts built inside keep their per-expert linears and the grouped path, on any device."""
    token = _GROUPED_ONLY.set(True)
    try:
        yield
    finally:
        _GROUPED_ONLY.reset(token)


def _fused_reason(device: torch.device) -> str:
    """Why experts on `device` run grouped rather than through the fused kernel ("" = fused)."""
    if _GROUPED_ONLY.get():
        return "calibration reads every expert's linear"
    if device.type != "cuda":
        return f"on {device.type} the grouped GEMMs are the fast path"
    from text_generation_server.kernels import fused_moe

    return fused_moe.machine_reason()


class Experts(torch.nn.Module):
    """The routed experts of one layer on this rank: partial outputs, before the all-reduce.

    fused: run the fused MoE kernel (stacked weights only, no per-expert linears); None decides
    by device (CUDA with Triton). Formats the kernel cannot read fall back to the grouped path.
    """

    def __init__(self, opts: ExpertOptions, weights: Weights, fused: bool | None = None):
        super().__init__()
        world = weights.process_group.size
        if opts.intermediate % world:
            raise CheckpointError(f"config.json: the experts' intermediate size ({opts.intermediate}) must be "
                                  f"divisible by the {world} shards")
        self.opts = opts
        self.local = opts.intermediate // world
        self.act = None if opts.act == SWIGLU_OAI else activation(opts.act)
        self.fused: torch.nn.Module | None = None
        self.w13 = self.b13 = self.w2 = self.b2 = None
        reason = "" if fused else ("asked for the grouped path" if fused is False else _fused_reason(weights.device))
        if not reason:
            reason = self._load_fused(weights)
        if reason and reason not in _LOGGED:
            _LOGGED.add(reason)
            logger.info("experts run grouped GEMMs per expert ({})", reason)
        self.gate_up = torch.nn.ModuleList()
        self.down = torch.nn.ModuleList()
        # Calibration hooks each expert's linears: every call must go through them.
        self.per_expert_calls = _GROUPED_ONLY.get()
        if self.fused is None:
            self._load_grouped(weights)

    def _load_grouped(self, weights: Weights) -> None:
        opts = self.opts
        gate_up, down = [], []
        for e in range(opts.num_experts):
            gate, up, down_name = opts.names(e)
            gate_up.append(TensorParallelColumnLinear.load_multi(
                weights, [gate, up], opts.bias, [opts.intermediate, opts.intermediate], opts.hidden))
            down.append(TensorParallelRowLinear.load(weights, down_name, opts.bias, opts.hidden, opts.intermediate))
        self.gate_up = torch.nn.ModuleList(gate_up)
        # The row-parallel wrappers' all-reduce is skipped: the block reduces once for all experts.
        self.down = torch.nn.ModuleList(down)
        stacked13 = _stack_dense([m.linear for m in gate_up])
        stacked2 = _stack_dense([m.linear for m in down])
        if stacked13 is not None and stacked2 is not None:
            self.w13, self.b13 = stacked13
            self.w2, self.b2 = stacked2

    def _load_fused(self, weights: Weights) -> str:
        """Stacks every expert's weights as the fused kernel reads them (dense, canonical int, or
        fp8); returns why not ("" when done)."""
        from text_generation_server.kernels import fused_moe
        from text_generation_server.kernels.base import QuantizedWeight
        from text_generation_server.kernels.fp8 import Fp8Weight
        from text_generation_server.quantizers.weights import UnquantizedWeight

        opts, pg = self.opts, weights.process_group
        pairs, downs = [], []
        for e in range(opts.num_experts):
            gate, up, down = opts.names(e)
            pairs.append((weights.get_weights_col(gate), weights.get_weights_col(up)))
            downs.append(weights.get_weights_row(down))
        kinds = {type(w) for pair in pairs for w in pair} | {type(w) for w in downs}
        try:
            if kinds == {UnquantizedWeight}:
                w13 = torch.stack([torch.cat([g.weight, u.weight]) for g, u in pairs])
                w2 = torch.stack([d.weight for d in downs])
            elif all(hasattr(w, "to_quantized") or isinstance(w, QuantizedWeight) for w in [*downs, *pairs[0]]):
                canon = (lambda w: w if isinstance(w, QuantizedWeight) else w.to_quantized())
                w13 = fused_moe.MoeGemmWeight.from_quantized([(canon(g), canon(u)) for g, u in pairs], weights.dtype)
                w2 = fused_moe.MoeGemmWeight.from_quantized([canon(d) for d in downs], weights.dtype)
            elif kinds == {Fp8Weight}:
                if any(w.activation != "none" for pair in pairs for w in pair):
                    return "the checkpoint quantizes expert activations to fp8, which the fused kernel does not"
                w13 = fused_moe.MoeFp8Weight.from_fp8_weights(pairs)
                w2 = fused_moe.MoeFp8Weight.from_fp8_weights(downs)
            else:
                return f"the fused kernel does not read {', '.join(sorted(k.__name__ for k in kinds))} experts"
        except ValueError as exc:
            return f"the fused kernel cannot stack these experts: {exc}"
        if opts.bias:
            self.b13 = torch.stack([torch.cat([weights.get_sharded(f"{g}.bias", dim=0),
                                               weights.get_sharded(f"{u}.bias", dim=0)])
                                    for g, u, _ in map(opts.names, range(opts.num_experts))])
            if pg.rank == 0:
                self.b2 = torch.stack([weights.get_tensor(f"{opts.names(e)[2]}.bias") for e in range(opts.num_experts)])
            else:  # the down bias is added once, by rank 0, as row-parallel linears do
                self.b2 = torch.zeros(opts.num_experts, opts.hidden, dtype=weights.dtype, device=weights.device)
        self.w13, self.w2 = w13, w2
        self.fused = fused_moe.FusedMoe(opts.num_experts, opts.top_k, opts.hidden, self.local, weights.dtype, weights.device,
                                        activation="swiglu_oai" if opts.act == SWIGLU_OAI else _FUSED_ACTS[opts.act],
                                        alpha=opts.swiglu_alpha, limit=opts.swiglu_limit)
        return ""

    @property
    def kernel_name(self) -> str:
        return "moe-fused-triton" if self.fused is not None else "moe-grouped"

    @property
    def graph_blocker(self) -> str | None:
        """Why a decode step through these experts cannot be a CUDA graph (None: it can)."""
        if self.fused is not None:
            return None
        return "mixture-of-experts layers group tokens by expert on the host without the fused MoE kernel"

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.local, dim=-1)
        if self.act is None:
            return swiglu_oai(gate, up, self.opts.swiglu_alpha, self.opts.swiglu_limit)
        return self.act(gate) * up

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # x: [T, H], weights/ids: [T, k] -> [T, H], this rank's partial sum
        if self.fused is not None:
            return self.fused(x, self.w13, self.w2, weights.float(), ids, self.b13, self.b2)
        return self.grouped(x, weights, ids)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each active expert's GEMMs over that expert's tokens.

        The (token, slot) pairs are sorted by expert once; the experts' weighted outputs fill their
        runs of one [T*k, H] buffer (two grouped GEMMs over stacked dense weights on CPU, else a pair
        of GEMMs per active expert), which is un-sorted with one gather and summed over the k slots
        (index_add_ over the tokens would be a serial scatter on CPU: 70% of a step)."""
        tokens, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // k
        weight_of = weights.reshape(-1).index_select(0, order)
        if (self.w13 is not None and self.w2 is not None and not self.per_expert_calls and _GROUPED_MM is not None
                and x.device.type == "cpu"):
            sorted_out = self._grouped_mm(x, flat, order, token_of, weight_of)
        else:
            sorted_out = self._per_expert(x, flat, token_of, weight_of)
        unsorted = sorted_out.index_select(0, torch.argsort(order))
        return unsorted.view(tokens, k, -1).sum(dim=1)

    def _grouped_mm(self, x: torch.Tensor, flat: torch.Tensor, order: torch.Tensor, token_of: torch.Tensor,
                    weight_of: torch.Tensor) -> torch.Tensor:
        """Both projections of every active expert as two grouped GEMMs over the stacked weights
        (torch's grouped_mm: one call walks the experts' row runs), no host sync and no Python
        loop over experts: what transformers' own grouped_mm experts do, and as exact in float32."""
        offs = torch.cumsum(torch.bincount(flat, minlength=self.opts.num_experts), 0).to(torch.int32)
        gate_up = _GROUPED_MM(x.index_select(0, token_of), self.w13.transpose(1, 2), offs=offs)
        expert_of = flat.index_select(0, order) if self.b13 is not None or self.b2 is not None else None
        if self.b13 is not None:
            gate_up = gate_up + self.b13.index_select(0, expert_of)
        out = _GROUPED_MM(self.activate(gate_up), self.w2.transpose(1, 2), offs=offs)
        if self.b2 is not None:
            out = out + self.b2.index_select(0, expert_of)
        return (out * weight_of[:, None]).to(x.dtype)

    def _per_expert(self, x: torch.Tensor, flat: torch.Tensor, token_of: torch.Tensor,
                    weight_of: torch.Tensor) -> torch.Tensor:
        """Each active expert's own linears over its tokens (quantized experts; calibration,
        whose hooks sit on those linears)."""
        counts = torch.bincount(flat, minlength=self.opts.num_experts).tolist()
        sorted_out = x.new_empty(flat.shape[0], x.shape[1])
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start:start + count]
            h = self.down[e].linear(self.activate(self.gate_up[e](x.index_select(0, rows))))
            sorted_out[start:start + count] = h * weight_of[start:start + count, None]
            start += count
        return sorted_out

    def linear_stages(self) -> list[list[str]]:
        n = self.opts.num_experts
        return [[f"gate_up.{e}" for e in range(n)], [f"down.{e}" for e in range(n)]]


class SparseMoE(torch.nn.Module):
    """Router, routed experts and an optional shared expert (Qwen2-MoE: gated by shared_gate;
    DeepSeek: ungated, a plain sum), one all-reduce."""

    # x: [tokens, hidden] -> [tokens, hidden]
    def __init__(self, router: Router, experts: Experts, process_group, shared: GatedMLP | None = None,
                 shared_gate: torch.Tensor | None = None):
        super().__init__()
        self.router = router
        self.experts = experts
        self.process_group = process_group
        self.shared = shared
        self.shared_gate = None if shared_gate is None else torch.nn.Parameter(shared_gate, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        out = self.process_group.all_reduce(self.experts(x, weights, ids))
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared
            out = out + shared
        return out

    def linear_stages(self) -> list[list[str]]:
        stages = [[f"experts.{p}" for p in stage] for stage in self.experts.linear_stages()]
        if self.shared is not None:
            stages += [[f"shared.{p}" for p in stage] for stage in self.shared.linear_stages()]
        return stages


def moe_layer_indices(layers: int, sparse_step: int, mlp_only: list[int], num_experts: int) -> set[int]:
    """The layers with routed experts, as Qwen-MoE picks them: every `decoder_sparse_step`-th
    layer (1-based) not listed in `mlp_only_layers`."""
    if num_experts <= 0:
        return set()
    return {i for i in range(layers) if i not in mlp_only and (i + 1) % sparse_step == 0}


"""Any causal LM transformers implements, through transformers' own modeling code.

For a model_type no native family covers (or `--model-impl transformers`), transformers builds
its model for the config on the meta device; the linears are then replaced, by name, with ours
(built through `Weights` and the checkpoint's loader, so quantized checkpoints and kernel
choice work as for native models, and tensor parallel follows the config's tp plan), the other
tensors load through `Weights` too, and an attention function registered with transformers'
attention interface stores K/V in our paged cache and attends through our attention backends
(windows and scale as the model passes them). So continuous batching, prefix caching, chunked
prefill, decode ahead and CUDA graphs run as they do for native models.

Architectures whose per-sequence state is not a KV cache (Mamba and linear-attention hybrids)
are refused by name: they would need a state cache this engine does not keep.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from loguru import logger

from text_generation_server.layers.attention import DEFAULT_BACKEND
from text_generation_server.layers.context import ForwardContext
from text_generation_server.layers.tensor_parallel import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelRowLinear,
)
from text_generation_server.models.decoder import DecoderConfig, Head
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.dist import ProcessGroup
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights

ATTENTION_NAME = "tgs_paged"
INSTALL_HINT = 'pip install "text-generation-server[transformers]"'
# model_types whose layers keep a recurrent or linear-attention state besides (or instead of) K/V.
NOT_KV_CACHE = {
    "mamba": "a Mamba state-space model", "mamba2": "a Mamba-2 state-space model",
    "falcon_mamba": "a Mamba state-space model", "falcon_h1": "a hybrid of attention and Mamba-2 layers",
    "jamba": "a hybrid of attention and Mamba layers", "bamba": "a hybrid of attention and Mamba-2 layers",
    "zamba": "a hybrid of attention and Mamba layers", "zamba2": "a hybrid of attention and Mamba-2 layers",
    "nemotron_h": "a hybrid of attention and Mamba-2 layers",
    "granitemoehybrid": "a hybrid of attention and Mamba-2 layers",
    "lfm2": "a hybrid of attention and short convolution layers",
    "lfm2_moe": "a hybrid of attention and short convolution layers",
    "qwen3_next": "a hybrid of attention and gated delta-net (linear attention) layers",
    "kimi_linear": "a hybrid of attention and linear-attention layers",
    "minimax": "a hybrid of attention and lightning (linear) attention layers",
    "recurrent_gemma": "a recurrent (RG-LRU) model", "rwkv": "a recurrent RWKV model",
    "xlstm": "a recurrent xLSTM model", "plamo2": "a hybrid of attention and Mamba layers",
}
KV_LAYER_TYPES = {"full_attention", "sliding_attention"}
# The forward being computed: set around transformers' forward, read by the attention function
# (not passed as a keyword: not every model hands its **kwargs down to attention).
_CURRENT: ContextVar[ForwardContext | None] = ContextVar("tgs_forward", default=None)
TP_STYLES = {"colwise", "rowwise", "packed_colwise", "colwise_gather_output", "rowwise_split_input"}


def transformers_version() -> str:
    """The installed transformers version; a CheckpointError saying what to install if none is."""
    try:
        import transformers
    except ImportError:
        raise CheckpointError(f"serving a model with no native implementation needs transformers: {INSTALL_HINT}") \
            from None
    return transformers.__version__


def knows(model_type: object) -> bool:
    """Whether the installed transformers has a config class for `model_type`."""
    transformers_version()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, **kwargs):
    """transformers' attention call over our paged cache: q [1, H, T, D], k/v [1, KVH, T, D] (rotary
    applied by the model) -> ([1, T, H, D], None). The forward's flattened sequences, their cache
    and block tables come from the running TransformersModel.forward; `attention_mask` is unused
    (masks follow the metadata)."""
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' runs only inside the server's forward")
    meta, cache = ctx.meta, ctx.cache
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    layer = module.layer_idx
    cache.store(layer, meta.slots, k, v)
    backend = meta.backend or DEFAULT_BACKEND
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window = sliding_window if sliding_window and sliding_window > 0 else None
    key_cache, value_cache = cache.keys[layer], cache.values[layer]
    # gpt-oss passes its attention sinks as s_aux (one logit per head of this rank).
    sinks = kwargs.get("s_aux")
    sinks = None if sinks is None else sinks.float()
    # Passed only for an fp8 cache: backends written before it keep their signature.
    kv = {} if (kv_scales := cache.scales_of(layer)) is None else {"kv_scales": kv_scales}
    if meta.is_prefill:
        out = backend.prefill(q, k, v, key_cache, value_cache, meta, scale, window, softcap=softcap, sinks=sinks,
                              **kv)
    else:
        out = backend.decode(q, key_cache, value_cache, meta, scale, window, softcap=softcap, sinks=sinks,
                             **kv)
    return out.unsqueeze(0), None


def refuse_unsupported(config: dict, source: str) -> None:
    """Architectures the paged KV cache cannot serve, refused with the reason."""
    model_type = config.get("model_type")
    if model_type in NOT_KV_CACHE:
        raise CheckpointError(f"{source}: model_type '{model_type}' is {NOT_KV_CACHE[model_type]}: its layers keep a "
                              "state that is not a KV cache, which this server does not serve")
    other = sorted({t for t in config.get("layer_types") or [] if t not in KV_LAYER_TYPES})
    if other:
        raise CheckpointError(f"{source}: layer_types {other} keep a state that is not a KV cache; only "
                              f"{sorted(KV_LAYER_TYPES)} layers are served")


def _tp_style(plan: dict[str, str], name: str) -> str | None:
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name):
            return style
    return None


class _Linear(torch.nn.Module):
    """One of our parallel linears where transformers keeps an nn.Linear: inputs of any leading
    shape ([1, T, K] in transformers' forward) run through our [tokens, K] kernels.

    gather: the rank's output columns are gathered into the whole output (transformers'
    colwise_gather_output); split: the whole input is cut to the rank's rows first
    (rowwise_split_input)."""

    def __init__(self, inner: torch.nn.Module, in_features: int, out_features: int, process_group: ProcessGroup,
                 gather: bool = False, split: bool = False):
        super().__init__()
        self.inner = inner
        self.in_features = in_features
        self.out_features = out_features
        self.process_group = process_group
        self.gather = gather
        self.split = split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        if self.split:
            share = x.shape[-1] // self.process_group.size
            x = x[:, self.process_group.rank * share:(self.process_group.rank + 1) * share]
        y = self.inner(x)
        if self.gather:
            y = self.process_group.all_gather_last_dim(y)
        return y.view(*lead, y.shape[-1])


class _Fused:
    """Sibling linears that read the same input (q/k/v, gate/up) computed as one matmul, as the
    native families do: the first member called with an input computes every member's output,
    the others take their slice. The input is held (so its memory cannot be reused by another
    tensor while the outputs are cached) and compared by identity (inference tensors keep no
    version counter; no model edits its hidden states in place between sibling projections); a
    member called with another input recomputes, so a model that feeds siblings differently
    stays correct."""

    def __init__(self, inner: torch.nn.Module, sizes: list[int]):
        self.inner = inner
        self.bounds = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        self._input: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._left = 0

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self._input is not x:
            self._out = self.inner(x.reshape(-1, x.shape[-1]))
            self._input, self._left = x, len(self.bounds)
        start, stop = self.bounds[index]
        out = self._out[:, start:stop]
        self._left -= 1
        if self._left <= 0:  # every member served: let go of the input and the outputs
            self._input = self._out = None
        return out.reshape(*x.shape[:-1], stop - start)


class _FusedMember(torch.nn.Module):
    def __init__(self, group: _Fused, index: int, in_features: int, out_features: int):
        super().__init__()
        self.group = group
        self.index = index
        self.in_features = in_features
        self.out_features = out_features
        if index == 0:
            self.inner = group.inner  # registered once, so kernels and parameters are found

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(x, self.index)


@dataclass(frozen=True)
class LoadReport:
    linears: int
    tensors: int
    parallel: int


class TransformersModel(torch.nn.Module):
    """transformers' base model with our linears, attention and head: the engine's model interface."""

    def __init__(self, config: DecoderConfig, hf_model: torch.nn.Module, head: Head, process_group: ProcessGroup,
                 softcap: bool, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.hf = hf_model
        self.base = getattr(hf_model, hf_model.base_model_prefix)
        self.head = head
        self.process_group = process_group
        self.attention_softcap = softcap
        self.attention_sinks = any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in hf_model.modules())
        self.dtype = dtype  # the compute dtype (a quantized head's parameters say nothing of it)

    @property
    def local_kv_heads(self) -> int:
        return self.config.num_key_value_heads // self.process_group.size

    def forward(self, input_ids, positions, cache, meta, logits_indices=None, head: bool = True, seq_lens=None):
        # input_ids, positions: [tokens] -> logits [len(logits_indices) or tokens, vocab] float32
        ctx = ForwardContext(positions, cache, meta, self.dtype, seq_lens)
        token = _CURRENT.set(ctx)
        try:
            with ctx.kernel_phase():
                out = self.base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            _CURRENT.reset(token)
        hidden = out.last_hidden_state[0]
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.logits(hidden) if head else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def hf_config(config: dict, source: str):
    """transformers' config object for a config.json (its defaults filled in)."""
    transformers_version()
    import transformers

    try:
        return transformers.AutoConfig.for_model(**config)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{source}: transformers {transformers.__version__} cannot read this config: "
                              f"{exc}") from exc


def decoder_config(config: dict, source: str) -> DecoderConfig:
    """What the engine needs to know, read through transformers' config class (its defaults)."""
    from text_generation_server.models.families.llama import layer_windows

    refuse_unsupported(config, source)
    raw = hf_config(config, source).to_dict()
    r = ConfigReader(raw, source)
    heads = r.positive_int("num_attention_heads")
    hidden = r.positive_int("hidden_size")
    layers = r.positive_int("num_hidden_layers")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type in ("dynamic", "longrope"):
        raise CheckpointError(f"{source}: rope type '{rope_type}' makes a token's rotary depend on its sequence's "
                              "length; transformers computes it for a whole batch at once, which is not what a "
                              "single sequence gets, so the transformers fallback refuses it")
    return DecoderConfig(
        model_type=raw.get("model_type"), vocab_size=r.positive_int("vocab_size"), hidden_size=hidden,
        intermediate_size=int(raw.get("intermediate_size") or 0), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=r.positive_int("num_key_value_heads", default=heads),
        head_dim=r.positive_int("head_dim", default=hidden // heads),
        max_position_embeddings=r.positive_int("max_position_embeddings", default=2048), rope=None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        layer_windows=layer_windows(r, layers, every_layer=True),
    )


def build(config: dict, weights: Weights, dtype: torch.dtype, source: str) -> TransformersModel:
    """transformers' model for a config.json, loaded through `weights` onto their device."""
    import transformers

    cfg = decoder_config(config, source)
    hf = hf_config(config, source)
    _register()
    pg = weights.process_group
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf, dtype=dtype, attn_implementation=ATTENTION_NAME)
    except ValueError as exc:
        raise CheckpointError(f"{source}: transformers {transformers.__version__} has no causal LM for model_type "
                              f"'{cfg.model_type}': {exc}") from exc
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if pg.size > 1:
        if not plan:
            raise CheckpointError(f"{source}: transformers gives model_type '{cfg.model_type}' no tensor-parallel "
                                  f"plan, so it runs on one rank only (--num-shard 1)")
        for what, value in (("num_attention_heads", cfg.num_attention_heads),
                            ("num_key_value_heads", cfg.num_key_value_heads)):
            if value % pg.size:
                raise CheckpointError(f"{source}: {what} ({value}) must be divisible by the {pg.size} shards")
    report = _load(model, weights, plan, pg.size > 1, source)
    # Head.load refuses a missing untied head itself (and accepts a quantized one).
    head_name = "lm_head"
    embed_name = _embedding_name(model)
    head = Head.load(weights, cfg, head_name, tied_prefix=embed_name,
                     bias=weights.has_tensor(f"{head_name}.bias"),
                     multiplier=getattr(hf, "logit_scale", None),
                     divisor=getattr(hf, "logits_scaling", None),
                     softcap=getattr(hf, "final_logit_softcapping", None))
    model.lm_head = torch.nn.Identity()  # ours is `head`; transformers' one is never called
    model.eval()
    softcap = getattr(hf, "attn_logit_softcapping", None) is not None
    if pg.rank == 0:
        logger.info("transformers {} implementation of {}: {} linears ours ({} split over {} ranks), {} other tensors",
                    transformers.__version__, type(model).__name__, report.linears, report.parallel, pg.size,
                    report.tensors)
    return TransformersModel(cfg, model, head, pg, softcap, dtype)


def _embedding_name(model: torch.nn.Module) -> str:
    embedding = model.get_input_embeddings()
    for name, module in model.named_modules():
        if module is embedding:
            return name
    raise CheckpointError(f"{type(model).__name__} has no input embedding module")


def _set(model: torch.nn.Module, name: str, value) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, value)


def _sibling_groups(model: torch.nn.Module, plan: dict[str, str]) -> list[list[str]]:
    """Linears of one parent module that the tp plan splits colwise and that share input size
    and bias: what transformers' code calls on one input (q/k/v, gate/up)."""
    by_parent: dict[tuple, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and _tp_style(plan, name) == "colwise":
            key = (name.rpartition(".")[0], module.in_features, module.bias is not None)
            by_parent.setdefault(key, []).append(name)
    return [names for names in by_parent.values() if len(names) > 1]


def _load(model: torch.nn.Module, weights: Weights, plan: dict[str, str], shard: bool, source: str) -> LoadReport:
    """Replaces every nn.Linear (bar the head) by ours and fills every other tensor from the
    checkpoint; non-persistent buffers (rotary frequencies) are computed as transformers does.
    The tp plan splits linears when `shard`; it groups colwise siblings into one matmul always."""
    device, linears, parallel = weights.device, 0, 0
    pg = weights.process_group
    view = pg if shard else ProcessGroup(0, 1)
    for names in _sibling_groups(model, plan):
        modules = [model.get_submodule(n) for n in names]
        k, sizes = modules[0].in_features, [m.out_features for m in modules]
        with weights.sharded_as(view):
            inner = TensorParallelColumnLinear.load_multi(weights, names, modules[0].bias is not None, sizes, k)
        group = _Fused(inner, [n // view.size for n in sizes])
        for index, (name, n) in enumerate(zip(names, sizes)):
            _set(model, name, _FusedMember(group, index, k, n // view.size))
        linears += len(names)
        parallel += len(names) if shard else 0
    if not shard:
        plan = {}
    for name, module in list(model.named_modules()):
        if name == "lm_head" or not isinstance(module, torch.nn.Linear):
            continue
        style = _tp_style(plan, name)
        if style is not None and style not in TP_STYLES:
            raise CheckpointError(f"{source}: the tensor-parallel plan splits '{name}' as '{style}', which is not "
                                  f"implemented here ({', '.join(sorted(TP_STYLES))} are); run it on one rank")
        bias = module.bias is not None
        k, n = module.in_features, module.out_features
        if style in ("rowwise", "rowwise_split_input"):
            inner = TensorParallelRowLinear.load(weights, name, bias, n, k)
        elif style == "packed_colwise":
            inner = TensorParallelColumnLinear.load_packed(weights, name, bias, [n // 2, n // 2], k)
        else:
            with weights.sharded_as(pg if style in ("colwise", "colwise_gather_output") else ProcessGroup(0, 1)):
                inner = TensorParallelColumnLinear.load(weights, name, bias, n, k)
        parallel += style is not None
        local_out = n if style in (None, "rowwise", "rowwise_split_input", "colwise_gather_output") else n // pg.size
        _set(model, name, _Linear(inner, k, local_out, pg, gather=style == "colwise_gather_output",
                                  split=style == "rowwise_split_input"))
        linears += 1
    embedding = model.get_input_embeddings()
    embed_name = _embedding_name(model)
    if type(embedding) is torch.nn.Embedding and _tp_style(plan, embed_name) == "embedding_rowwise":
        _set(model, embed_name, TensorParallelEmbedding(weights, embed_name, embedding.num_embeddings,
                                                         embedding.embedding_dim, keep_stored=False))
        parallel += 1
    buffers = []
    for name, buffer in list(model.named_buffers()):
        if buffer.is_meta:
            owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            owner.register_buffer(name.rpartition(".")[2], torch.empty_like(buffer, device=device),
                                  persistent=False)
            buffers.append(owner)
    for owner in {id(m): m for m in buffers}.values():
        model._init_weights(owner)
    tensors = 0
    for name, param in list(model.named_parameters()):
        if not param.is_meta or name.startswith("lm_head."):
            continue
        tensor = weights.get_tensor(name)
        if list(tensor.shape) != list(param.shape):
            raise CheckpointError(f"tensor '{name}' has shape {list(tensor.shape)}, transformers' "
                                  f"{type(model).__name__} expects {list(param.shape)} (in {weights.files_of(name)})")
        _set(model, name, torch.nn.Parameter(tensor, requires_grad=False))
        tensors += 1
    left = [n for n, p in model.named_parameters() if p.is_meta and not n.startswith("lm_head.")]
    if left:
        raise CheckpointError(f"{source}: tensors never loaded: {', '.join(left[:5])}")
    return LoadReport(linears, tensors, parallel)

"""Rotary position embeddings: every scaling transformers implements for the families we serve.

Types (config.json `rope_scaling` / `rope_parameters`): default, linear, llama3, yarn, dynamic
(NTK, recomputed from the sequence's length) and longrope (Phi-3's short/long factors). The
frequencies follow transformers' `modeling_rope_utils` (read there, written here), so the
angles agree to float32 rounding. config.json's rope settings are read here only
(`rope_parameters`, `layered_rope_parameters`), in the order transformers' config classes give
them precedence, so every family and the softmax scale that depends on the rope see the same.

cos/sin are computed per forward from the positions (one multiply, cos and sin of
[tokens, rotary_dim / 2]), not gathered from a table: nothing grows with the context, no host
sync is needed (CUDA graphs capture it), and the length-dependent types (dynamic, longrope)
take a per-token sequence length instead of one for the whole batch, so every sequence of a
batch gets the frequencies transformers would give it alone.

Two layouts of the rotated pairs: `rotate_half` (Llama, GPT-NeoX: dimension i pairs with
i + d/2) and interleaved (Cohere, GPT-J: 2i pairs with 2i + 1). A partial rotary factor rotates
the first `rotary_dim` dimensions of each head and passes the rest through.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from loguru import logger

from text_generation_server.kernels import cpu_pointwise, fused_pointwise

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    # None: config.json gave none (yarn and longrope then imply one). Not 1.0: transformers'
    # _compute_yarn_parameters / _compute_longrope_parameters imply a factor only when it `is None`,
    # and an explicit 1.0 stays 1.0.
    factor: float | None = None
    partial_rotary_factor: float = 1.0
    interleaved: bool = False
    # The model's max_position_embeddings: dynamic NTK's base length, and the implied factor of
    # yarn/longrope configs that give none.
    max_position_embeddings: int = 2048
    # llama3, yarn, longrope: the pretraining context.
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # longrope
    short_factor: tuple[float, ...] = field(default=())
    long_factor: tuple[float, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type '{self.rope_type}' is not supported (supported: {', '.join(ROPE_TYPES)})")
        if self.factor is None and self.rope_type in ("linear", "dynamic", "llama3"):
            raise ValueError(f"rope type '{self.rope_type}' needs a factor")
        if self.factor is not None and not self.factor > 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"rotary dimension {self.rotary_dim} (head_dim {self.head_dim} x partial_rotary_factor "
                             f"{self.partial_rotary_factor}) must be even and at least 2")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope: high_freq_factor must be greater than low_freq_factor")
        if self.rope_type == "longrope":
            half = self.rotary_dim // 2
            for name in ("short_factor", "long_factor"):
                values = getattr(self, name)
                if len(values) != half:
                    raise ValueError(f"rope longrope: {name} has {len(values)} entries, expected {half} "
                                     f"(rotary dimension / 2)")
        if self.rope_type in ("llama3", "yarn", "longrope") and self.original_max_position_embeddings is None:
            raise ValueError(f"rope {self.rope_type}: original_max_position_embeddings is required")

    # -- frequencies ---------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def _exponents(self) -> torch.Tensor:
        return torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim

    def _implied_factor(self) -> float:
        # transformers: a yarn/longrope config without `factor` scales by the ratio of the two lengths.
        if self.factor is not None:
            return self.factor
        if self.original_max_position_embeddings is None:
            return 1.0
        return self.max_position_embeddings / self.original_max_position_embeddings

    def inv_freq(self) -> torch.Tensor:
        """[rotary_dim / 2] float32: the frequencies at (or below) the base length; for longrope
        the short factors."""
        inv = 1.0 / (self.theta ** self._exponents())
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv)
        if self.rope_type == "yarn":
            return self._yarn()
        if self.rope_type == "longrope":
            return 1.0 / (torch.tensor(self.short_factor, dtype=torch.float32) * self.theta ** self._exponents())
        return inv

    def long_inv_freq(self) -> torch.Tensor:
        """longrope's frequencies for sequences past original_max_position_embeddings."""
        return 1.0 / (torch.tensor(self.long_factor, dtype=torch.float32) * self.theta ** self._exponents())

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        old_len = self.original_max_position_embeddings
        low_wavelen = old_len / self.low_freq_factor
        high_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def _yarn(self) -> torch.Tensor:
        dim, base, factor = self.rotary_dim, self.theta, self._implied_factor()
        original = self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: no zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (factor * pos_freqs)
        keep = 1 - ramp  # share of extrapolation per frequency
        return interpolation * (1 - keep) + extrapolation * keep

    @property
    def attention_scaling(self) -> float:
        """The factor transformers multiplies cos and sin by (yarn's mscale, longrope's)."""
        if self.rope_type == "yarn":
            if self.attention_factor is not None:
                return float(self.attention_factor)
            factor = self._implied_factor()

            def mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            if self.mscale and self.mscale_all_dim:
                return float(mscale(factor, self.mscale) / mscale(factor, self.mscale_all_dim))
            return mscale(factor)
        if self.rope_type == "longrope":
            if self.attention_factor is not None:
                return float(self.attention_factor)
            factor = self._implied_factor()
            if factor <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(factor) / math.log(self.original_max_position_embeddings))
        return 1.0

    @property
    def length_dependent(self) -> bool:
        """Whether a token's frequencies depend on its sequence's length (dynamic, longrope)."""
        return self.rope_type in ("dynamic", "longrope")

    def max_context(self, max_position_embeddings: int) -> int:
        """Positions the model may reach: dynamic NTK stretches to max_position_embeddings x factor
        (as TGI's launcher allows); yarn to original_max_position_embeddings x factor when the config
        left max_position_embeddings at the pretraining length (Qwen2.5's long-context recipe)."""
        if self.rope_type == "dynamic":
            return int(max_position_embeddings * self.factor)
        if self.rope_type == "yarn" and self.original_max_position_embeddings is not None:
            return max(max_position_embeddings, int(self.original_max_position_embeddings * self._implied_factor()))
        return max_position_embeddings


def _maybe_float(params: dict, key: str, source: str) -> float | None:
    """params[key] as a float; None when absent or null."""
    value = params.get(key)
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: rope parameter '{key}' must be a number, got {value!r}") from None


def _float(params: dict, key: str, default: float, source: str) -> float:
    """params[key] as a float; `default` when absent or null."""
    value = _maybe_float(params, key, source)
    return default if value is None else value


@dataclass(frozen=True)
class RopeDefaults:
    """How a model type's config.json names its rope base and rotated share, and the values it
    gets when config.json gives none: what transformers' config class of that type does (its
    `default_theta`; GPT-NeoX's rotary_emb_base and rotary_pct, default 0.25; Phi's share 0.5;
    gpt-oss's yarn when config.json has no rope dict at all)."""

    theta: float = 10000.0
    theta_key: str = "rope_theta"
    partial_rotary_factor: float | None = None  # None: the whole head unless config.json says
    partial_key: str = "partial_rotary_factor"
    parameters: dict[str, Any] | None = None  # the rope dict of a config.json with neither rope key


# Types scaled relative to a pretraining length (original_max_position_embeddings).
_PRETRAINED_LENGTH_TYPES = ("llama3", "yarn", "longrope")
_SOURCE = "config.json"


def _top(config: dict, key: str, default):
    value = config.get(key)
    return default if value is None else value


def _standardize(params: dict, config: dict, theta: float, partial: float | None, nested: bool) -> None:
    """Fills one rope dict in place as transformers' standardize_rope_params does: the type under
    `rope_type` (legacy `type`), the base and the rotated share where the dict has none, and the
    pretraining length of the types that scale relative to it."""
    if params.get("rope_theta") is None:
        params["rope_theta"] = theta
    if partial is not None and params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = partial
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    phi3 = config.get("model_type") == "phi3"
    if phi3 and rope_type == "yarn":
        # Phi3Config.convert_rope_params_to_dict: old Phi-3 configs call longrope "yarn" (and "su",
        # which transformers 5 then fails to validate, so it stays refused here too).
        rope_type = "longrope"
    params["rope_type"] = rope_type
    if rope_type not in _PRETRAINED_LENGTH_TYPES:
        return
    max_pos = int(config.get("max_position_embeddings") or 2048)
    if nested:
        # A per-layer dict keeps its own; a top-level key does not reach it.
        if params.get("original_max_position_embeddings") is None:
            params["original_max_position_embeddings"] = max_pos
        return
    # Every ROPE_INIT_FUNCTIONS entry re-runs standardize_rope_params on the loaded config, where
    # a top-level original_max_position_embeddings overrides the flat dict's (Phi3Config always
    # has one, default 4096); missing everywhere, max_position_embeddings.
    top = config.get("original_max_position_embeddings")
    if phi3 and top is None:
        top = 4096
    if top is not None:
        params["original_max_position_embeddings"] = top
    elif params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = max_pos


def _rope_dict(config: dict, key: str) -> dict:
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"{_SOURCE}: {key} must be an object, got {value!r}")
    return copy.deepcopy(value)


def _is_nested(params: dict) -> bool:
    return any(isinstance(v, dict) for v in params.values())


def rope_parameters(config: dict, defaults: RopeDefaults = RopeDefaults()) -> dict:
    """The rope parameters transformers runs config.json with: one dict for every layer, or one
    per layer type where config.json nests them so (a new dict; `config` is left as it is).

    As transformers' config classes read them (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict):
    a `rope_scaling` present in config.json replaces `rope_parameters` whole (model cards tell users
    to add one to a config that has rope_parameters, to extend the context), its type under
    `rope_type` or the legacy `type`; the base then comes from the dict itself, else config.json's
    top-level key, else the model type's default, never from the rope_parameters it replaced.
    """
    if config.get("rope_scaling"):
        params = _rope_dict(config, "rope_scaling")
    elif config.get("rope_parameters") is None and defaults.parameters is not None:
        params = copy.deepcopy(defaults.parameters)
    else:
        params = _rope_dict(config, "rope_parameters")
    theta = _top(config, defaults.theta_key, defaults.theta)
    partial = _top(config, defaults.partial_key, defaults.partial_rotary_factor)
    if _is_nested(params):
        for entry in params.values():
            if isinstance(entry, dict):
                _standardize(entry, config, theta, partial, nested=True)
    else:
        _standardize(params, config, theta, partial, nested=False)
    return params


def layered_rope_parameters(config: dict, bases: dict[str, tuple[str, float]],
                            scaled: str = "full_attention") -> dict[str, dict]:
    """Rope parameters per layer type, as Gemma 3's config class reads them
    (Gemma3TextConfig.convert_rope_params_to_dict), where each layer type has its own rope.

    `bases`: layer type -> (the top-level key of its base, its default). config.json's nested
    `rope_parameters` give each type's dict (a default rope for a type they lack; a flat dict is
    taken as the `scaled` type's); a `rope_scaling` updates only the `scaled` (full-attention)
    entry, key by key (so a legacy `type` does not replace a `rope_type` already there), and the
    other types keep theirs.
    """
    params = _rope_dict(config, "rope_parameters")
    if params and not _is_nested(params):
        params = {scaled: params}
    if config.get("rope_scaling") is not None:
        entry = params.get(scaled)
        params[scaled] = {**(entry if isinstance(entry, dict) else {"rope_type": "default"}),
                          **_rope_dict(config, "rope_scaling")}
    partial = config.get("partial_rotary_factor")
    for layer_type, (key, default) in bases.items():
        entry = params.get(layer_type)
        if not isinstance(entry, dict):
            entry = params[layer_type] = {"rope_type": "default"}
        _standardize(entry, config, _top(config, key, default), partial, nested=True)
    return params


def rope_config_from_hf(config: dict, head_dim: int, layer_type: str | None = None, interleaved: bool = False,
                        defaults: RopeDefaults = RopeDefaults(), params: dict | None = None) -> RopeConfig:
    """The rope of config.json's `layer_type` layers (None: of every layer).

    `params`: the rope parameters as transformers standardises them, when the family read them
    itself (`layered_rope_parameters`); by default `rope_parameters(config, defaults)`: the older
    `rope_theta` + `rope_scaling`, or transformers 5's `rope_parameters`, possibly nested by
    layer type (Gemma 3's sliding_attention / full_attention).
    """
    source = _SOURCE
    if params is None:
        params = rope_parameters(config, defaults)
    nested = layer_type is not None and isinstance(params.get(layer_type), dict)
    if nested:
        params = params[layer_type]
    elif _is_nested(params):
        raise ValueError(f"{source}: rope_parameters is nested by layer type ({', '.join(params)}) but this layer's "
                         f"type is {layer_type!r}")
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: rope type '{rope_type}' is not supported (supported: {', '.join(ROPE_TYPES)})")
    factor = params.get("factor")
    if factor is None and rope_type in ("linear", "dynamic", "llama3"):
        raise ValueError(f"{source}: rope type '{rope_type}' needs rope_scaling.factor")
    original = params.get("original_max_position_embeddings")
    return RopeConfig(
        head_dim=head_dim,
        theta=_float(params, "rope_theta", RopeDefaults.theta, source),
        rope_type=rope_type,
        factor=_maybe_float(params, "factor", source),
        partial_rotary_factor=_float(params, "partial_rotary_factor", 1.0, source),
        interleaved=interleaved,
        max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
        original_max_position_embeddings=int(original) if original is not None else None,
        low_freq_factor=_float(params, "low_freq_factor", 1.0, source),
        high_freq_factor=_float(params, "high_freq_factor", 4.0, source),
        beta_fast=_maybe_float(params, "beta_fast", source) or 32.0,
        beta_slow=_maybe_float(params, "beta_slow", source) or 1.0,
        mscale=_maybe_float(params, "mscale", source),
        mscale_all_dim=_maybe_float(params, "mscale_all_dim", source),
        attention_factor=_maybe_float(params, "attention_factor", source),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
    )


class RotaryEmbedding(torch.nn.Module):
    """cos and signed sin for a forward's positions, in the layout `apply` expects."""

    def __init__(self, config: RopeConfig, max_positions: int, device: torch.device):
        super().__init__()
        if max_positions < 1:
            raise ValueError(f"rotary embedding needs at least one position, got {max_positions}")
        self.config = config
        self.max_positions = max_positions
        self.inv_freq = config.inv_freq().to(device)
        self.long_inv_freq = config.long_inv_freq().to(device) if config.rope_type == "longrope" else None
        self.scaling = config.attention_scaling
        self.length_dependent = config.length_dependent
        # sin carries the sign of the rotation: [-s, s] halves (rotate_half) or (-s, s) pairs.
        half = config.rotary_dim // 2
        sign = torch.ones(config.rotary_dim, device=device)
        if config.interleaved:
            sign[0::2] = -1
        else:
            sign[:half] = -1
        self._sign = sign
        # One-row CPU decode steps read cos/sin from blocks of positions computed once (`decode_cos_sin`):
        # dtype -> {block: (cos, sin)}; None once a block's rows were found to differ from one-row calls.
        self._decode_blocks: dict[torch.dtype, dict[int, tuple[torch.Tensor, torch.Tensor]]] | None = {}

    def _freqs(self, positions: torch.Tensor, seq_lens: torch.Tensor | None) -> torch.Tensor:
        # -> [tokens, rotary_dim / 2] angles, float32
        pos = positions.float()[:, None]
        cfg = self.config
        if not self.length_dependent or seq_lens is None:
            return pos * self.inv_freq[None, :]
        lengths = seq_lens.to(device=positions.device)
        if cfg.rope_type == "longrope":
            long = (lengths > cfg.original_max_position_embeddings)[:, None]
            return pos * torch.where(long, self.long_inv_freq[None, :], self.inv_freq[None, :])
        # dynamic NTK: the base grows with the sequence once it passes max_position_embeddings.
        base_len = cfg.max_position_embeddings
        dim = cfg.rotary_dim
        lengths = torch.clamp(lengths, min=base_len).float()[:, None]
        base = cfg.theta * ((cfg.factor * lengths / base_len) - (cfg.factor - 1)) ** (dim / (dim - 2))
        exps = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
        return pos * (1.0 / (base ** exps[None, :]))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None,
                seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin: [tokens, 1, rotary_dim] in `dtype`.

        seq_lens [tokens]: the length each token's sequence has in the forward that computes it
        (length-dependent types only; None: the position + 1). max_position bounds `positions`
        (a host int the caller knows); it is checked against the model's context, never read
        from the device.
        """
        if max_position is not None and max_position >= self.max_positions:
            raise ValueError(f"position {max_position} is past the {self.max_positions} positions this model "
                             "supports (max_position_embeddings, stretched by its rope scaling)")
        if self.length_dependent and seq_lens is None:
            seq_lens = positions + 1
        freqs = self._freqs(positions, seq_lens)
        if self.config.interleaved:
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        else:
            emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype).unsqueeze(1), (sin * self._sign).to(dtype).unsqueeze(1)

    DECODE_BLOCK = 64  # positions per block of `decode_cos_sin`

    def decode_cos_sin(self, position: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`cos_sin` of one position on the CPU ([1, 1, rotary_dim] views), from a block of 64 positions
        computed together the first time one of them is asked for; None where this embedding's
        frequencies depend on the sequence's length, or its blocks were found to differ from one-row
        calls (the caller then calls `cos_sin`).

        Why: a single-stream decode step asked `cos_sin` for its one position, ~10 small torch ops
        (20-130 us on the 2-core EPYC with OpenMP's passive waits, up to 10% of the embedded model's
        step). The block's rows are the bits a one-row call gives (elementwise ops on the same
        values); each new block's first and last rows are compared with one-row calls, and any
        difference (a torch whose cos takes another path for a longer tensor) turns the blocks off."""
        blocks = self._decode_blocks
        if blocks is None or self.length_dependent or not 0 <= position < self.max_positions:
            return None
        per_dtype = blocks.get(dtype)
        if per_dtype is None:
            per_dtype = blocks[dtype] = {}
        block, row = divmod(position, self.DECODE_BLOCK)
        found = per_dtype.get(block)
        if found is None:
            start = block * self.DECODE_BLOCK
            end = min(start + self.DECODE_BLOCK, self.max_positions)
            positions = torch.arange(start, end, device=self.inv_freq.device)
            cos, sin = self.cos_sin(positions, dtype, end - 1)
            for i in (0, end - start - 1):
                one_cos, one_sin = self.cos_sin(positions[i:i + 1], dtype, start + i)
                if not (torch.equal(one_cos, cos[i:i + 1]) and torch.equal(one_sin, sin[i:i + 1])):
                    logger.warning("rotary: a block of positions computed together differs from one-row calls "
                                   "(position {}); decode steps compute cos/sin per step", start + i)
                    self._decode_blocks = None
                    return None
            found = per_dtype[block] = (cos, sin)
        cos, sin = found
        return cos[row:row + 1], sin[row:row + 1]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] rotated by cos/sin [tokens, 1, rotary_dim]."""
        return apply_rotary(x, cos, sin, self.config.interleaved)

    def apply_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, cache, layer: int, slots: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q, k) rotated, with the rotated k and v written into `cache` (a KVCache) at `slots`, in
        one fused launch (fused_pointwise.rotary_store) where it runs: CUDA, a 16-bit cache of the
        layer's dtype (not fp8), full-width rotate-half rotary. None: the caller rotates and stores."""
        if not (fused_pointwise.usable_store(q) and _fusable(q, cos, sin, self.config.interleaved) and
                _fusable(k, cos, sin, False) and v.dim() == 3 and v.stride(-1) == 1 and v.shape == k.shape):
            return None
        if cache.scales_of(layer) is not None or cache.values[layer] is None:
            return None
        keys, values = cache.keys[layer], cache.values[layer]
        if not (keys.dtype == values.dtype == k.dtype == v.dtype and keys.is_contiguous() and values.is_contiguous()
                and keys.shape == values.shape and keys.shape[2:] == k.shape[1:] and slots.dtype == torch.long
                and slots.shape == (k.shape[0],)):
            return None
        return fused_pointwise.rotary_store(q, k, v, cos, sin, keys, values, slots)


def _partner(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Each dimension's rotation partner: i + d/2 (rotate_half) or its pair neighbour."""
    if interleaved:
        return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x.roll(x.shape[-1] // 2, dims=-1)


def _fusable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> bool:
    """Whether the fused rotary kernels take x [tokens, heads, head_dim] with these cos/sin."""
    rot = cos.shape[-1]
    return (not interleaved and rot == x.shape[-1] and rot % 2 == 0 and x.dim() == 3 and x.stride(-1) == 1
            and cos.dtype == x.dtype == sin.dtype and cos.shape == sin.shape == (x.shape[0], 1, rot)
            and cos.stride() == sin.stride() and cos.stride(-1) == 1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """transformers' x * cos + rotate(x) * sin, the rotation's sign folded into `sin`."""
    # x: [tokens, heads, head_dim]; cos/sin: [tokens, 1, rotary_dim]
    rot = cos.shape[-1]
    if fused_pointwise.usable(x) and _fusable(x, cos, sin, interleaved):
        return fused_pointwise.rotary(x, cos, sin)  # one launch on CUDA instead of three
    native = cpu_pointwise.module_for(x)
    if native is not None and rot == x.shape[-1] and cpu_pointwise.rotary_fits(x, cos, sin, interleaved):
        return cpu_pointwise.rotary(native, x, cos, sin)  # one call on the CPU (bfloat16), the same bits
    native = cpu_pointwise.module_for_f32(x)
    if native is not None and rot == x.shape[-1] and cpu_pointwise.rotary_f32_fits(x, cos, sin, interleaved):
        return cpu_pointwise.rotary_f32(native, x, cos, sin)  # one call on the CPU (float32), the same bits
    if rot == x.shape[-1]:
        return torch.addcmul(x * cos, _partner(x, interleaved), sin)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotated = torch.addcmul(x_rot * cos, _partner(x_rot, interleaved), sin)
    return torch.cat([rotated, x_pass], dim=-1)

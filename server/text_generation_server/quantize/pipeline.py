"""`text-generation-server quantize`: a dense Llama-family checkpoint in, a GPTQ checkpoint out.

The model is never built whole. Calibration ids are embedded with the embedding
matrix alone; then each decoder layer is built from its own tensors (Weights reads
safetensors lazily), the calibration activations run through it while hooks
accumulate each linear's Hessian, its linears are quantized (GPTQ or RTN), the
dequantized weights replace the originals, and the quantized layer's outputs
become the next layer's inputs. Peak memory is one float32 decoder layer plus the
calibration activations, so models larger than RAM in float32 still quantize.

Shards are written as tensors are produced, into a temporary folder next to
OUTPUT_DIR that is renamed into place only when complete: an interrupted run never
leaves a folder that looks like a valid checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from loguru import logger
from safetensors.torch import save_file

from text_generation_server.kernels.base import QuantizedWeight, dequantize
from text_generation_server.layers.attention import AttentionMetadata, KVCache
from text_generation_server.layers.rotary import RotaryEmbedding
from text_generation_server.models.llama import FUSED_PROJECTIONS, LlamaConfig, LlamaLayer
from text_generation_server.perplexity import calibration_samples, calibration_text
from text_generation_server.quantizers.config import GPTQConfig, read_quantization_config
from text_generation_server.quantizers.gptq_solver import (
    HessianAccumulator, gptq_quantize, gptq_tensors, output_error, packing_multiple, split_columns,
)
from text_generation_server.quantizers.rtn import SUPPORTED_BITS, rtn_quantize
from text_generation_server.utils.checkpoint import Checkpoint
from text_generation_server.utils.progress import Progress, clock
from text_generation_server.weights import CheckpointError, Weights, safetensors_files

METHODS = ("gptq", "rtn")
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
# Activation scratch of one layer forward (float32): bounds how many samples run at once. Larger
# forwards amortise per-call overhead; 256 MiB is 17 samples of 1024 tokens on tiny-pycoder and
# one 2048-token sample on a 7B layer, whose forward is then a few seconds of matmuls anyway.
FORWARD_BYTES = 256 * 2**20
# The unquantized layer's outputs are kept for this many samples, to report how far the
# quantized layer's outputs move ("layer output" in the log): enough tokens for a stable
# figure, without a second copy of every calibration activation.
REFERENCE_SAMPLES = 16
PROGRESS_INTERVAL = 5.0  # seconds between progress lines when stderr is not a terminal


class QuantizeError(ValueError):
    """The quantize command cannot run with these arguments on this model."""


@dataclass(frozen=True)
class QuantizeOptions:
    bits: int = 4
    group_size: int = 128  # -1: per output channel
    sym: bool = True
    act_order: bool = False
    static_groups: bool = False
    percdamp: float = 0.01
    true_sequential: bool = True
    method: str = "gptq"
    checkpoint_format: str = "gptq"
    modules_to_not_convert: tuple[str, ...] = ()
    dataset: Path | None = None  # None: the train split of the stdlib corpus
    nsamples: int = 128
    seqlen: int | None = None  # None: min(2048, max_position_embeddings)
    seed: int = 0
    overwrite: bool = False
    max_shard_bytes: int = 2 * 1024**3
    device: str = "cpu"

    def validate(self) -> None:
        """Checks that need no model, so a typo fails before anything is read."""
        if self.bits not in SUPPORTED_BITS:
            raise QuantizeError(f"--bits {self.bits} is not supported (choose {', '.join(map(str, SUPPORTED_BITS))})")
        if self.group_size != -1 and self.group_size <= 0:
            raise QuantizeError(f"--groupsize must be -1 (per-channel) or positive, got {self.group_size}")
        if self.method not in METHODS:
            raise QuantizeError(f"--method '{self.method}' is not supported (choose {', '.join(METHODS)})")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise QuantizeError(f"--checkpoint-format '{self.checkpoint_format}' is not supported "
                                f"(choose {', '.join(CHECKPOINT_FORMATS)})")
        if not 0.0 <= self.percdamp < 1.0:
            raise QuantizeError(f"--percdamp must be in [0, 1), got {self.percdamp}")
        if self.nsamples < 1:
            raise QuantizeError(f"--nsamples must be at least 1, got {self.nsamples}")
        if self.seqlen is not None and self.seqlen < 1:
            raise QuantizeError(f"--seqlen must be at least 1, got {self.seqlen}")
        if self.method == "rtn" and self.act_order:
            raise QuantizeError("--act-order orders columns by calibration statistics: it needs --method gptq")
        if self.max_shard_bytes < 1:
            raise QuantizeError("the shard size must be positive")
        kind = self.device.split(":")[0]
        if kind not in ("cpu", "cuda"):
            raise QuantizeError(f"--device '{self.device}' is not supported (choose cpu or cuda)")
        if kind == "cuda" and not torch.cuda.is_available():
            raise QuantizeError(f"--device {self.device}: CUDA is not available on this machine")

    @property
    def min_zero(self) -> int:
        # GPTQ v1 stores z - 1, so an asymmetric zero point of 0 cannot be written.
        return 1 if self.checkpoint_format == "gptq" and not self.sym else 0

    def quantization_config(self, seqlen: int | None = None) -> dict:
        """config.json's quantization_config: every key GPTQ loaders read, written truthfully."""
        config = {
            "quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.act_order,
            "sym": self.sym, "static_groups": self.static_groups, "damp_percent": self.percdamp,
            "true_sequential": self.true_sequential, "checkpoint_format": self.checkpoint_format, "lm_head": False,
            "meta": {"quantizer": "text-generation-server", "method": self.method, "nsamples": self.nsamples,
                     "seqlen": seqlen if seqlen is not None else self.seqlen, "seed": self.seed,
                     "dataset": str(self.dataset) if self.dataset is not None else "stdlib-corpus:train"},
        }
        if self.modules_to_not_convert:
            config["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return config


@dataclass(frozen=True)
class LinearGroup:
    """Checkpoint tensors that run as one matmul (and so share their input Hessian)."""

    module: str  # path of the TensorParallel wrapper inside LlamaLayer
    tensors: tuple[str, ...]  # checkpoint names relative to the layer prefix
    rows: tuple[int, ...]  # output rows of each tensor, in fused order
    in_features: int


def linear_groups(config: LlamaConfig) -> list[list[LinearGroup]]:
    """The layer's linears in the order true-sequential quantizes them: stage by stage."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    if config.model_type in FUSED_PROJECTIONS:
        qkv = LinearGroup("self_attn.qkv", ("self_attn.qkv_proj",), (q + 2 * kv,), hidden)
        gate_up = LinearGroup("mlp.gate_up", ("mlp.gate_up_proj",), (2 * inter,), hidden)
    else:
        qkv = LinearGroup("self_attn.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                          (q, kv, kv), hidden)
        gate_up = LinearGroup("mlp.gate_up", ("mlp.gate_proj", "mlp.up_proj"), (inter, inter), hidden)
    return [[qkv], [LinearGroup("self_attn.o_proj", ("self_attn.o_proj",), (hidden,), q)], [gate_up],
            [LinearGroup("mlp.down", ("mlp.down_proj",), (hidden,), inter)]]


def check_shapes(config: LlamaConfig, options: QuantizeOptions) -> None:
    """Group size and packing constraints, checked on every linear before any work starts."""
    multiple = packing_multiple(options.bits)
    for stage in linear_groups(config):
        for group in stage:
            k = group.in_features
            names = "/".join(t.split(".")[-1] for t in group.tensors)
            if options.group_size != -1 and k % options.group_size != 0:
                raise QuantizeError(
                    f"--groupsize {options.group_size} does not divide the {k} input features of {names} "
                    f"(hidden_size {config.hidden_size}, intermediate_size {config.intermediate_size}); "
                    f"use a divisor of every input size or -1"
                )
            for size, what in [(k, "input features")] + [(n, "output features") for n in group.rows]:
                if size % multiple != 0:
                    raise QuantizeError(f"{names} has {size} {what}, which {options.bits}-bit GPTQ packing cannot "
                                        f"store (it needs a multiple of {multiple})")


def dense_groups(config: LlamaConfig, options: QuantizeOptions) -> set[tuple[int, str]]:
    """(layer, group module) pairs that --modules-to-not-convert leaves dense; fused parts must agree."""
    if not options.modules_to_not_convert:
        return set()
    rule = GPTQConfig(source="--modules-to-not-convert", bits=options.bits,
                      modules_to_not_convert=options.modules_to_not_convert)
    dense = set()
    for layer in range(config.num_hidden_layers):
        for stage in linear_groups(config):
            for group in stage:
                prefixes = [f"model.layers.{layer}.{t}" for t in group.tensors]
                kept = [not rule.quantizes(p) for p in prefixes]
                if any(kept) and not all(kept):
                    raise QuantizeError(
                        f"--modules-to-not-convert leaves only part of {', '.join(prefixes)} dense: they run as "
                        "one matmul, so list all of them or none"
                    )
                if all(kept):
                    dense.add((layer, group.module))
    return dense


# -- writing the GPTQ checkpoint ----------------------------------------------------------
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
              "tokenizer.model", "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja")


class ShardWriter:
    """Tensors go to safetensors shards as they are produced, so memory holds at most one shard."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder = folder
        self.max_bytes = max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.total_bytes = 0
        self.files: list[Path] = []
        self.weight_map: dict[str, int] = {}  # tensor -> shard number

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.weight_map or name in self.pending:
            raise QuantizeError(f"tensor '{name}' written twice")
        tensor = tensor.contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.folder / f"shard-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        for name in self.pending:
            self.weight_map[name] = len(self.files)
        self.files.append(path)
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[Path]:
        """Names the shards model-0000i-of-0000n.safetensors and writes the index."""
        self.flush()
        count = len(self.files)
        names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for path, name in zip(self.files, names):
            os.rename(path, self.folder / name)
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": {k: names[v] for k, v in sorted(self.weight_map.items())}}
        index_path = self.folder / "model.safetensors.index.json"
        index_path.write_text(json.dumps(index, indent=2) + "\n")
        self.files = [self.folder / n for n in names]
        for path in self.files:  # save_file creates owner-only files; give shards the umask's mode
            os.chmod(path, index_path.stat().st_mode & 0o777)
        return self.files


def copy_side_files(source: Path, target: Path) -> None:
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)


class InputsCollected(Exception):
    """Raised by the hook of a stage's last linear: the rest of the layer's forward is not needed."""


def forward_scratch_bytes(config: LlamaConfig) -> int:
    """Float32 activation bytes one token needs in a layer forward (its widest moments: the MLP's
    gate/up output with its product, and attention's q/k/v with the residual stream)."""
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    return 4 * (3 * config.intermediate_size + qkv + 4 * config.hidden_size)


class AttentionReplay(torch.nn.Module):
    """Stands in for a layer's self_attn once q/k/v are final: o_proj over recorded inputs.

    The layer's own forward still runs the residual and the MLP, so a replayed pass
    computes exactly what the full forward would, without attention or q/k/v.
    """

    def __init__(self, o_proj: torch.nn.Module, recorded: torch.Tensor):
        super().__init__()
        self.o_proj = o_proj
        self.recorded = recorded  # [nsamples, seqlen, heads * head_dim]
        self.current: torch.Tensor | None = None  # this chunk's rows, set by the runner

    def forward(self, hidden, cos, sin, cache, meta):  # the LlamaAttention signature
        return self.o_proj(self.current)


class LayerRunner:
    """Runs one decoder layer over all calibration samples, a few samples per forward."""

    def __init__(self, config: LlamaConfig, seqlen: int, nsamples: int, device: torch.device,
                 forward_bytes: int | None = None):
        self.seqlen = seqlen
        self.nsamples = nsamples
        per_sample = forward_scratch_bytes(config) * seqlen
        budget = FORWARD_BYTES if forward_bytes is None else forward_bytes
        self.chunk = max(1, min(nsamples, budget // per_sample))
        tokens = self.chunk * seqlen
        self.rotary = RotaryEmbedding(config.rope, seqlen, device)
        positions = torch.arange(seqlen, device=device).repeat(self.chunk)
        self.cos, self.sin = self.rotary.cos_sin(positions, torch.float32)
        # Prefill attention reads K/V straight from the projections; the cache is only written.
        # One block pool aliased under every layer id keeps that scratch at one layer's size.
        self.cache = KVCache(1, 1, tokens, config.num_key_value_heads, config.head_dim, torch.float32, device)
        self.cache.keys = self.cache.keys * config.num_hidden_layers
        self.cache.values = self.cache.values * config.num_hidden_layers
        self.device = device
        self.start = 0  # first sample of the chunk being run
        self.needs_outputs = False  # whether this chunk's layer outputs are kept (hooks must not stop it)

    @property
    def batches(self) -> int:
        """Forwards per pass over the calibration samples."""
        return -(-self.nsamples // self.chunk)

    @torch.inference_mode()
    def run(self, layer: torch.nn.Module, inputs: torch.Tensor, outputs: torch.Tensor | None,
            record: torch.Tensor | None = None, replay: torch.Tensor | None = None,
            on_batch: Callable[[], None] | None = None) -> None:
        """One pass. inputs: [nsamples, seqlen, hidden]; outputs: [<= nsamples, seqlen, hidden], the
        first rows of the result (may be inputs: each chunk is read before it is written).
        record: [nsamples, seqlen, q] filled with o_proj's inputs; replay: such a recording, used
        instead of attention."""
        attn = layer.self_attn
        stand_in = AttentionReplay(attn.o_proj, replay) if replay is not None else None
        hook = None
        if record is not None:
            # Before any Hessian hook on o_proj, which may stop the forward.
            hook = _module(layer, "self_attn.o_proj").register_forward_pre_hook(
                lambda _m, args: self._record(record, args[0]), prepend=True)
        if stand_in is not None:
            layer.self_attn = stand_in
        try:
            for start in range(0, inputs.shape[0], self.chunk):
                self.start = start
                x = inputs[start:start + self.chunk]
                b, tokens = x.shape[0], x.shape[0] * self.seqlen
                self.needs_outputs = outputs is not None and start < outputs.shape[0]
                if stand_in is not None:
                    stand_in.current = replay[start:start + b].reshape(tokens, -1)
                meta = AttentionMetadata(is_prefill=True, slots=torch.arange(tokens, device=self.device),
                                         prefill_lens=[self.seqlen] * b)
                try:
                    y = layer(x.reshape(tokens, -1), self.cos[:tokens], self.sin[:tokens], self.cache, meta)
                except InputsCollected:
                    y = None
                keep = 0 if outputs is None or y is None else min(b, outputs.shape[0] - start)
                if keep > 0:
                    outputs[start:start + keep] = y.reshape(b, self.seqlen, -1)[:keep]
                if on_batch is not None:
                    on_batch()
        finally:
            if stand_in is not None:
                layer.self_attn = attn
            if hook is not None:
                hook.remove()

    def _record(self, record: torch.Tensor, x: torch.Tensor) -> None:
        # x: [tokens, q] for the chunk that starts at sample self.start
        b = x.shape[0] // self.seqlen
        record[self.start:self.start + b] = x.reshape(b, self.seqlen, -1)


def _module(layer: torch.nn.Module, path: str) -> torch.nn.Module:
    """The DenseLinear inside the TensorParallel wrapper at `path` (the input is checked to be dense)."""
    return layer.get_submodule(path).linear


def _collect(acc: HessianAccumulator, x: torch.Tensor, stop: bool) -> None:
    acc.add(x)
    if stop:
        raise InputsCollected


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.float().pow(2).sum())
    return float((a.float() - b.float()).pow(2).sum()) / den if den > 0 else 0.0


def _names(group: LinearGroup) -> str:
    return "+".join(t.split(".")[-1] for t in group.tensors)


class Quantizer:
    """One quantize run: options, model, and the per-layer loop."""

    def __init__(self, model: str, output_dir: Path, options: QuantizeOptions):
        options.validate()
        self.options = options
        self.checkpoint = Checkpoint.open(model)
        folder = self.checkpoint.folder
        config_path = folder / "config.json"
        if "quantization_config" in self.checkpoint.config or read_quantization_config(folder, None) is not None:
            raise QuantizeError(f"{folder} is already quantized (see {config_path} or quantize_config.json): "
                                "quantize a dense checkpoint")
        self.config = LlamaConfig.from_dict(self.checkpoint.config, source=str(config_path))
        self.output_dir = Path(output_dir).expanduser().resolve()
        if self.output_dir == folder.resolve():
            raise QuantizeError(f"OUTPUT_DIR {self.output_dir} is the input model folder")
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise QuantizeError(f"OUTPUT_DIR {self.output_dir} exists and is not a folder")
        if self.output_dir.exists() and not options.overwrite:
            raise QuantizeError(f"OUTPUT_DIR {self.output_dir} already exists (pass --overwrite to replace it)")
        max_pos = self.config.max_position_embeddings
        self.seqlen = options.seqlen if options.seqlen is not None else min(2048, max_pos)
        if self.seqlen > max_pos:
            raise QuantizeError(f"--seqlen {self.seqlen} exceeds the model's max_position_embeddings ({max_pos})")
        check_shapes(self.config, options)
        self.dense = dense_groups(self.config, options)
        self.device = torch.device(options.device)
        self.weights = Weights(safetensors_files(folder), self.device, torch.float32)

    # -- the pipeline ----------------------------------------------------------------
    def run(self) -> Path:
        parent = self.output_dir.parent
        parent.mkdir(parents=True, exist_ok=True)
        staging = parent / f".{self.output_dir.name}.partial-{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        try:
            self._write(staging)
            self._commit(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return self.output_dir

    def _write(self, staging: Path) -> None:
        opts = self.options
        writer = ShardWriter(staging, opts.max_shard_bytes)
        inputs = self._embedded_samples() if opts.method == "gptq" else None
        runner = LayerRunner(self.config, self.seqlen, opts.nsamples, self.device) if inputs is not None else None
        layers = self.config.num_hidden_layers
        plans = [self._stages(i) for i in range(layers)]
        units = [self._units(plan, runner) for plan in plans]
        if runner is not None:
            logger.info("calibration: {} forward(s) of {} sample(s) per pass", runner.batches, runner.chunk)
        started = time.monotonic()
        with Progress(sum(units) + 1, title="quantize", interval=PROGRESS_INTERVAL) as progress:
            for i in range(layers):
                layer_started = time.monotonic()
                progress.item(f"layer {i + 1}/{layers}")
                layer = LlamaLayer(self.config, self.weights, i, runner.rotary if runner else
                                   RotaryEmbedding(self.config.rope, 1, self.device)).eval()
                quantized, summary = self._quantize_layer(i, layer, plans[i], runner, inputs, progress)
                self._write_layer(writer, i, quantized)
                del layer
                elapsed = time.monotonic() - started
                eta = elapsed / (i + 1) * (layers - i - 1)
                progress.log("layer {}/{} [{}] {}: {:.1f} s, elapsed {}, ETA {}", i + 1, layers, _bar(i + 1, layers),
                             summary, time.monotonic() - layer_started, clock(elapsed), clock(eta))
            progress.step("writing embeddings, norms and head", 1, unit="step")
            for name in self.weights.source.keys():
                if not name.startswith("model.layers."):
                    writer.add(name, self._raw(name))
            files = writer.finish()
            progress.advance(1)
        config = dict(self.checkpoint.config)
        config["quantization_config"] = opts.quantization_config(self.seqlen)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "quantize_config.json").write_text(
            json.dumps({k: v for k, v in config["quantization_config"].items() if k != "meta"}, indent=2) + "\n")
        copy_side_files(self.checkpoint.folder, staging)
        logger.info("wrote {} shard(s), {:.1f} MB, in {}", len(files), writer.total_bytes / 1e6,
                    clock(time.monotonic() - started))

    def _commit(self, staging: Path) -> None:
        """Moves the finished folder into place; an existing OUTPUT_DIR is replaced only now."""
        old = None
        if self.output_dir.exists():
            old = self.output_dir.parent / f".{self.output_dir.name}.old-{os.getpid()}"
            os.rename(self.output_dir, old)
        try:
            os.rename(staging, self.output_dir)
        except OSError:
            if old is not None:
                os.rename(old, self.output_dir)  # put the previous output back
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("quantized checkpoint written to {}", self.output_dir)

    def _raw(self, name: str) -> torch.Tensor:
        """A checkpoint tensor exactly as stored (dtype kept)."""
        return self.weights.get_tensor(name, to_dtype=False).cpu()

    def _embedded_samples(self) -> torch.Tensor:
        ids = calibration_samples(
            self.checkpoint.tokenizer, calibration_text(self.options.dataset, self.options.nsamples * self.seqlen,
                                                        self.options.seed),
            self.options.nsamples, self.seqlen, self.options.seed)
        embedding = self.weights.get_tensor("model.embed_tokens.weight")
        if ids.max() >= embedding.shape[0]:
            raise CheckpointError(f"the tokenizer produced id {int(ids.max())}, outside the embedding's "
                                  f"{embedding.shape[0]} rows")
        logger.info("calibration: {} samples x {} tokens", ids.shape[0], ids.shape[1])
        return torch.nn.functional.embedding(ids.to(self.device), embedding)  # [nsamples, seqlen, hidden]

    def _stages(self, index: int) -> list[list[LinearGroup]]:
        """The groups of layer `index` to quantize, stage by stage (a stage is one calibration pass)."""
        stages = linear_groups(self.config)
        if not self.options.true_sequential:
            stages = [[group for stage in stages for group in stage]]
        todo = [[g for g in stage if (index, g.module) not in self.dense] for stage in stages]
        return [stage for stage in todo if stage]

    @staticmethod
    def _units(stages: list[list[LinearGroup]], runner: LayerRunner | None) -> int:
        """Progress units of one layer: a unit per calibration forward and per solve."""
        solves = sum(len(stage) for stage in stages)
        return solves if runner is None else solves + (len(stages) + 1) * runner.batches

    def _quantize_layer(self, index: int, layer: torch.nn.Module, stages: list[list[LinearGroup]],
                        runner: LayerRunner | None, inputs: torch.Tensor | None,
                        progress: Progress) -> tuple[dict[str, QuantizedWeight], str]:
        """Quantizes the layer's linears in place (dense weights replaced by their dequantized values)."""
        quantized: dict[str, QuantizedWeight] = {}
        errors: list[str] = []
        reference = None  # the unquantized layer's outputs, first REFERENCE_SAMPLES samples
        attention = None  # o_proj's inputs once q/k/v are final: later passes skip attention
        qkv_final = (index, "self_attn.qkv") in self.dense
        passes = len(stages) + 1
        for number, todo in enumerate(stages, 1):
            hessians = {}
            if runner is not None:
                # A pass stops once the stage's last linear (in forward order) has seen its inputs,
                # except where it keeps outputs: the first pass runs the unquantized layer to the
                # end on the first REFERENCE_SAMPLES samples.
                first = number == 1
                if first:
                    reference = torch.empty_like(inputs[:REFERENCE_SAMPLES])
                record = None
                # Every chunk of this pass reaches o_proj unless the pass stops at q/k/v.
                if attention is None and qkv_final and todo[-1].module != "self_attn.qkv":
                    width = _module(layer, "self_attn.o_proj").weight.shape[1]
                    record = attention = inputs.new_empty(inputs.shape[0], self.seqlen, width)
                hooks = []
                for group in todo:
                    acc = HessianAccumulator(group.in_features, self.device)
                    hessians[group.module] = acc
                    hooks.append(_module(layer, group.module).register_forward_pre_hook(
                        lambda _m, args, acc=acc, last=group is todo[-1]:
                        _collect(acc, args[0], last and not runner.needs_outputs)))
                progress.step(f"pass {number}/{passes}: inputs of {', '.join(_names(g) for g in todo)}",
                              runner.batches)
                try:
                    runner.run(layer, inputs, reference if first else None, record=record,
                               replay=attention if record is None else None, on_batch=progress.advance)
                finally:
                    for hook in hooks:
                        hook.remove()
            for group in todo:
                progress.step(f"{'gptq' if runner is not None else 'rtn'} {_names(group)}", 1, unit="solve")
                h = hessians[group.module].hessian if runner is not None else None
                quantized.update(self._quantize_group(index, layer, group, h, errors))
                progress.advance()
                qkv_final = qkv_final or group.module == "self_attn.qkv"
        summary = " ".join(errors) if errors else "all linears left dense"
        if runner is not None:
            # In place: the next layer calibrates on this quantized layer's outputs.
            progress.step(f"pass {passes}/{passes}: outputs for the next layer", runner.batches)
            runner.run(layer, inputs, inputs, replay=attention, on_batch=progress.advance)
            if reference is not None:
                summary += f" | layer output {_relative(inputs[:reference.shape[0]], reference):.2e}"
        return quantized, summary

    def _quantize_group(self, index: int, layer: torch.nn.Module, group: LinearGroup,
                        hessian: torch.Tensor | None, errors: list[str]) -> dict[str, QuantizedWeight]:
        opts = self.options
        module = _module(layer, group.module)
        weight = module.weight.data  # [sum(rows), K]
        if hessian is not None:
            result = gptq_quantize(weight, hessian, opts.bits, opts.group_size, opts.sym, opts.act_order,
                                   opts.static_groups, opts.percdamp, min_zero=opts.min_zero)
            qweight, dequantized = result.weight, result.dequantized
        else:
            qweight = rtn_quantize(weight, opts.bits, opts.group_size, opts.sym, min_zero=opts.min_zero)
            dequantized = dequantize(qweight).to(weight.device)
        out = {}
        offset = 0
        for name, rows in zip(group.tensors, group.rows):
            part = slice(offset, offset + rows)
            if hessian is not None:
                err = output_error(weight[part], dequantized[part], hessian)
            else:
                err = _relative(dequantized[part], weight[part])
            errors.append(f"{name.split('.')[-1]} {err:.2e}")
            out[f"model.layers.{index}.{name}"] = split_columns(qweight, offset, rows)
            offset += rows
        module.weight.data.copy_(dequantized)
        return out

    def _write_layer(self, writer: ShardWriter, index: int, quantized: dict[str, QuantizedWeight]) -> None:
        prefix = f"model.layers.{index}."
        replaced = {f"{name}.weight": name for name in quantized}
        for name in sorted(k for k in self.weights.source.keys() if k.startswith(prefix)):
            if name in replaced:
                for key, tensor in gptq_tensors(replaced[name], quantized[replaced[name]],
                                                self.options.checkpoint_format).items():
                    writer.add(key, tensor)
            else:
                writer.add(name, self._raw(name))


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = math.floor(width * done / total)
    return "#" * filled + "." * (width - filled)


def quantize(model: str, output_dir: str | Path, options: QuantizeOptions) -> Path:
    """Quantizes `model` (a folder or the embedded id) into `output_dir`; returns the folder."""
    return Quantizer(model, Path(output_dir), options).run()

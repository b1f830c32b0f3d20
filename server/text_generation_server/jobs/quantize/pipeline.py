"""`text-generation-server quantize`: a dense checkpoint of any native family in, GPTQ out.

The model is never built whole. Calibration ids go through the family's embeddings alone;
then each decoder layer is built from its own tensors (Weights reads safetensors lazily), the
calibration activations run through it while hooks accumulate each linear's Hessian, its
linears are quantized (GPTQ or RTN), the dequantized weights replace the originals, and the
quantized layer's outputs become the next layer's inputs. Peak memory is one float32 decoder
layer plus the calibration activations, so models larger than RAM in float32 still quantize.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from loguru import logger
from text_generation_server.kernels.base import QuantizedWeight, dequantize
from text_generation_server.layers.moe import grouped_experts_only
from text_generation_server.models.registry import read_model_config
from text_generation_server.models.decoder import DecoderLayer
from text_generation_server.jobs.perplexity import calibration_samples, calibration_text
from text_generation_server.jobs.quantize.calibration import (
    LayerRunner,
    LinearGroup,
    check_shapes,
    collect,
    dense_groups,
    linear_groups,
    module_linear,
)
from text_generation_server.jobs.quantize.options import QuantizeError, QuantizeOptions
from text_generation_server.jobs.quantize.writer import ShardWriter, Staging, copy_side_files
from text_generation_server.quantizers.factory import read_quantization_config, tensor_source
from text_generation_server.quantizers.gguf_arch import side_files
from text_generation_server.quantizers.gguf_file import gguf_files
from text_generation_server.quantizers.gptq_solver import (
    HessianAccumulator,
    gptq_quantize,
    gptq_tensors,
    output_error,
    split_columns,
)
from text_generation_server.quantizers.rtn import rtn_quantize
from text_generation_server.utils.locate import open_checkpoint
from text_generation_server.utils.progress import Progress, clock
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights

# The unquantized layer's outputs are kept for this many samples, to report how far the
# quantized layer's outputs move ("layer output" in the log): enough tokens for a stable
# figure, without a second copy of every calibration activation.
REFERENCE_SAMPLES = 16
PROGRESS_INTERVAL = 5.0  # seconds between progress lines when stderr is not a terminal
# A linear that sees fewer calibration tokens (a mixture-of-experts expert the router rarely
# picks) is quantized with RTN: its Hessian would say nothing about the inputs it will get.
MIN_CALIBRATION_ROWS = 8


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.float().pow(2).sum())
    return float((a.float() - b.float()).pow(2).sum()) / den if den > 0 else 0.0


class Quantizer:
    """One quantize run: options, model, and the per-layer loop."""

    def __init__(self, model: str, output_dir: Path, options: QuantizeOptions):
        options.validate()
        self.options = options
        self.checkpoint = open_checkpoint(model)
        folder = self.checkpoint.folder
        config_path = folder / "config.json"
        # A GGUF is read dequantized (quantizers/gguf_file.py): its blocks are the input, not the output format.
        self.gguf = gguf_files(folder)
        existing = read_quantization_config(folder, None) if self.gguf is None else None
        if "quantization_config" in self.checkpoint.config or existing is not None:
            raise QuantizeError(f"{folder} is already quantized (see {config_path} or quantize_config.json): "
                                "quantize a dense checkpoint")
        self.family, self.config = read_model_config(self.checkpoint.config, source=str(config_path))
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
        self.device = torch.device(options.device)
        self.weights = Weights(tensor_source(folder), self.device, torch.float32)
        self.family.prepare(self.config, self.weights)
        # Stored name -> the name the family reads it by. Layers are found by the family's names, but
        # tensors are written under the stored ones: a checkpoint read through aliases (GPT2Model's
        # "h.0..." for "transformer.h.0...") keeps its own naming, and none of its layers is missed.
        self.read_names = self.weights.read_names()
        # Stacked tensors the family reads per part (gpt-oss experts): the output stores the parts,
        # quantized or as read, and not the stacks.
        self.derived = self.weights.derived
        self.stacked = {view.stored for view in self.derived.values()}
        # Calibration positions run to seqlen; RTN runs no forward (one position is enough).
        self.rotaries = self.family.rotaries(self.config, self.seqlen, self.device)
        # Layers of one kind have the same linears: read them off the first layer of each kind
        # (a mixture of experts may keep some layers dense).
        by_kind: dict[object, list[list[LinearGroup]]] = {}
        self.groups: list[list[list[LinearGroup]]] = []
        for index in range(self.config.num_hidden_layers):
            kind = self.family.layer_kind(self.config, index)
            if kind not in by_kind:
                layer = self._layer(index)
                by_kind[kind] = linear_groups(layer, self._prefix(index))
                del layer
                check_shapes(by_kind[kind], options)
            self.groups.append(by_kind[kind])
        self.dense = dense_groups(self.groups, self.family.layer_prefix, options)

    def _prefix(self, index: int) -> str:
        return f"{self.family.layer_prefix}.{index}"

    def _layer(self, index: int) -> DecoderLayer:
        # Calibration hooks every linear, so experts keep theirs (no fused kernel, even on CUDA).
        with grouped_experts_only():
            return self.family.layer(self.config, self.weights, index, self.rotaries).eval()

    # -- the pipeline ----------------------------------------------------------------
    def run(self) -> Path:
        with Staging(self.output_dir) as staging:
            self._write(staging)
        return self.output_dir

    def _write(self, staging: Path) -> None:
        opts = self.options
        writer = ShardWriter(staging, opts.max_shard_bytes)
        inputs = self._embedded_samples() if opts.method == "gptq" else None
        runner = LayerRunner(self.config, self.rotaries, self.seqlen, opts.nsamples, self.device) \
            if inputs is not None else None
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
                layer = self._layer(i)
                quantized, summary = self._quantize_layer(i, layer, plans[i], runner, inputs, progress)
                self._write_layer(writer, i, quantized)
                del layer
                elapsed = time.monotonic() - started
                eta = elapsed / (i + 1) * (layers - i - 1)
                progress.log("layer {}/{} [{}] {}: {:.1f} s, elapsed {}, ETA {}", i + 1, layers, _bar(i + 1, layers),
                             summary, time.monotonic() - layer_started, clock(elapsed), clock(eta))
            progress.step("writing embeddings, norms and head", 1, unit="step")
            for stored in self.weights.stored.keys():
                if stored not in self.stacked and not self.read_names[stored].startswith(self.family.layer_prefix + "."):
                    writer.add(stored, self._raw(stored))
            files = writer.finish()
            progress.advance(1)
        config = dict(self.checkpoint.config)
        config["quantization_config"] = opts.quantization_config(self.seqlen)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "quantize_config.json").write_text(
            json.dumps({k: v for k, v in config["quantization_config"].items() if k != "meta"}, indent=2) + "\n")
        if self.gguf is not None:
            for name, text in side_files(self.gguf).items():
                if name != "config.json":
                    (staging / name).write_text(text)
        else:
            copy_side_files(self.checkpoint.folder, staging)
        logger.info("wrote {} shard(s), {:.1f} MB, in {}", len(files), writer.total_bytes / 1e6,
                    clock(time.monotonic() - started))

    def _raw(self, name: str) -> torch.Tensor:
        """A checkpoint tensor exactly as stored (dtype and layout kept: Conv1D stays [in, out]); a
        derived one as the family reads it."""
        if name in self.derived:
            return self.weights.source.get_slice(name)[...].cpu()
        return self.weights.stored.get_slice(name)[...].cpu()

    def _embedded_samples(self) -> torch.Tensor:
        ids = calibration_samples(
            self.checkpoint.tokenizer, calibration_text(self.options.dataset, self.options.nsamples * self.seqlen,
                                                        self.options.seed),
            self.options.nsamples, self.seqlen, self.options.seed)
        if ids.max() >= self.config.vocab_size:
            raise CheckpointError(f"the tokenizer produced id {int(ids.max())}, outside the embedding's "
                                  f"{self.config.vocab_size} rows")
        logger.info("calibration: {} samples x {} tokens", ids.shape[0], ids.shape[1])
        # What the first layer receives: the family's embeddings (scaled, plus learned positions).
        embeddings = self.family.embeddings(self.config, self.weights)
        positions = torch.arange(self.seqlen, device=self.device).repeat(ids.shape[0])
        with torch.inference_mode():
            hidden = embeddings(ids.to(self.device).flatten(), positions)
        return hidden.view(ids.shape[0], self.seqlen, -1).clone()  # [nsamples, seqlen, hidden]

    def _stages(self, index: int) -> list[list[LinearGroup]]:
        """The groups of layer `index` to quantize, stage by stage (a stage is one calibration pass)."""
        stages = self.groups[index]
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
                    width = module_linear(layer, "self_attn.o_proj").weight.shape[1]
                    record = attention = inputs.new_empty(inputs.shape[0], self.seqlen, width)
                hooks = []
                for group in todo:
                    acc = HessianAccumulator(group.in_features, self.device)
                    hessians[group.module] = acc
                    hooks.append(module_linear(layer, group.module).register_forward_pre_hook(
                        lambda _m, args, acc=acc, last=group is todo[-1]:
                        collect(acc, args[0], last and not runner.needs_outputs)))
                progress.step(f"pass {number}/{passes}: inputs of {', '.join(g.names for g in todo)}",
                              runner.batches)
                try:
                    runner.run(layer, inputs, reference if first else None, record=record,
                               replay=attention if record is None else None, on_batch=progress.advance)
                finally:
                    for hook in hooks:
                        hook.remove()
            for group in todo:
                progress.step(f"{'gptq' if runner is not None else 'rtn'} {group.names}", 1, unit="solve")
                h = None
                if runner is not None:
                    seen = hessians[group.module].rows
                    if seen >= MIN_CALIBRATION_ROWS:
                        h = hessians[group.module].hessian
                    else:
                        # An expert the router sends (almost) no calibration token to: GPTQ would
                        # solve against nothing, so its weights are rounded instead.
                        logger.warning("layer {}: {} saw {} calibration token(s) (fewer than {}): quantized "
                                       "with RTN", index, group.module, seen, MIN_CALIBRATION_ROWS)
                        errors.append(f"[{group.module}: rtn]")
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
        module = module_linear(layer, group.module)
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
            out[f"{self._prefix(index)}.{name}"] = split_columns(qweight, offset, rows)
            offset += rows
        module.weight.data.copy_(dequantized)
        return out

    def _write_layer(self, writer: ShardWriter, index: int, quantized: dict[str, QuantizedWeight]) -> None:
        prefix = f"{self._prefix(index)}."
        replaced = {f"{name}.weight": name for name in quantized}  # by the family's names
        for stored in sorted(k for k, name in self.read_names.items()
                             if name.startswith(prefix) and k not in self.stacked):
            name = self.read_names[stored]
            if name in replaced:
                # Under the stored weight's own prefix, as its other tensors (bias) are kept.
                for key, tensor in gptq_tensors(stored.removesuffix(".weight"), quantized[replaced[name]],
                                                self.options.checkpoint_format).items():
                    writer.add(key, tensor)
            else:
                writer.add(stored, self._raw(stored))


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = math.floor(width * done / total)
    return "#" * filled + "." * (width - filled)


def quantize(model: str, output_dir: str | Path, options: QuantizeOptions) -> Path:
    """Quantizes `model` (a folder or the embedded id) into `output_dir`; returns the folder."""
    return Quantizer(model, Path(output_dir), options).run()

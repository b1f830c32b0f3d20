"""Model construction: from a model argument to a ready `CausalLM`."""

from __future__ import annotations

from typing import Sequence

import torch
from loguru import logger

from text_generation_server.engine.causal_lm import CausalLM
from text_generation_server.engine.cuda_graphs import GraphCapturer
from text_generation_server.engine.standin import from_environment as standin_from_environment
from text_generation_server.kernels.kv_fp8 import is_fp8
from text_generation_server.layers.attention import KVLayout
from text_generation_server.models.kv_cache import layer_scales, resolve_kv_cache_dtype, skip_layers
from text_generation_server.models.registry import read_model_config
from text_generation_server.quantizers.dist import ProcessGroup, single_process_group
from text_generation_server.quantizers.factory import (
    get_loader, read_kv_cache_declaration, read_quantization_config, tensor_source,
)
from text_generation_server.quantizers.weights import Weights
from text_generation_server.settings.serve_args import parse_kv_skip_layers
from text_generation_server.utils.locate import open_checkpoint
from text_generation_server.utils.progress import CountingSource, current_startup

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def quantize_head(net: torch.nn.Module, method: str, dtype: torch.dtype, log: bool) -> None:
    """Replaces a dense lm_head by its int8 form (`--quantize-lm-head`); a head the checkpoint
    already quantized is kept."""
    from text_generation_server.layers.tensor_parallel import TensorParallelHead, int8_head
    from text_generation_server.settings.serve_args import LM_HEAD_QUANTIZATIONS

    if method not in LM_HEAD_QUANTIZATIONS:
        raise ValueError(f"--quantize-lm-head must be one of {', '.join(LM_HEAD_QUANTIZATIONS)}, got {method!r}")
    head = net.head
    if not isinstance(head.projection, TensorParallelHead):
        if log:
            logger.info("--quantize-lm-head {}: the checkpoint's head is quantized already; kept", method)
        return
    dense = head.projection.weight
    head.projection = int8_head(head.projection, dtype)
    if log:
        logger.info("lm_head as per-row int8 on kernel {}: {:.0f} MiB of codes per rank instead of {:.0f} MiB {}",
                    getattr(head.projection.linear, "kernel_name", "?"), dense.numel() / 2**20,
                    dense.numel() * dense.element_size() / 2**20, str(dense.dtype).removeprefix("torch."))


def head_quantization(asked: str | None, qconfig: object | None, device: torch.device) -> tuple[str | None, str]:
    """The lm_head's method (None: as the checkpoint stores it) and why, from --quantize-lm-head
    (None and "none": as stored; "auto", what `serve` asks when the flag is not given: the default).

    The default: int8 on the CPU for a checkpoint quantized to 8 bits or fewer. Decode there is bound by
    the bytes it reads, and a small model's head is a quarter or more of them: left in bf16 beside
    4-bit layers it costs as much as all of them (llama.cpp's default quantizations keep the head at
    Q6_K/Q8_0 for the same reason). Dense checkpoints keep their head dense; on CUDA the default
    stays the checkpoint's, where the head's bytes weigh less against the launch-bound step."""
    from text_generation_server.settings.serve_args import LM_HEAD_AUTO, LM_HEAD_NONE

    if asked is None or asked == LM_HEAD_NONE:
        return None, "--quantize-lm-head none"
    if asked != LM_HEAD_AUTO:
        return asked, f"--quantize-lm-head {asked}"
    bits = getattr(qconfig, "bits", 8)
    if qconfig is None or device.type != "cpu" or not isinstance(bits, int) or bits > 8:
        return None, "default"
    return "int8", (f"default for a {qconfig.describe()} checkpoint on the CPU; --quantize-lm-head none "  # type: ignore[attr-defined]
                    "(QUANTIZE_LM_HEAD=none) keeps it as stored")


def resolve_dtype(name: str | None, device: torch.device, config: dict) -> torch.dtype:
    """The compute dtype: as asked, else float32 on CPU and the checkpoint's half type on CUDA."""
    if name is not None:
        if name not in DTYPES:
            raise ValueError(f"dtype '{name}' is not supported (choose from {', '.join(DTYPES)})")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if config.get("torch_dtype", config.get("dtype")) == "bfloat16" else torch.float16


def get_model(
    model: str | None,
    dtype: str | None = None,
    device: torch.device | None = None,
    process_group: ProcessGroup | None = None,
    quantize: str | None = None,
    block_size: int = 16,
    attention_backend: str | None = None,
    cuda_graphs: Sequence[int] = (),
    max_batch_size: int | None = None,
    graph_capturer: GraphCapturer | None = None,
    model_impl: str = "auto",
    quantize_lm_head: str | None = None,
    kv_cache_dtype: str | None = None,
    kv_cache_fp8_skip_layers: str | None = None,
) -> CausalLM:
    """Loads `model` (a checkpoint folder or id; None: the embedded model), ready for warmup.

    cuda_graphs: decode batch sizes to capture as CUDA graphs at warmup (ignored off CUDA);
    max_batch_size: the most requests a decode step will hold (what warmup measures);
    graph_capturer: how graphs are recorded (default: CUDA graphs; tests pass an emulation);
    model_impl: "auto", "native" or "transformers" (see `registry.model_impl`);
    quantize_lm_head: "int8" runs a dense head as per-row int8, None or "none" keeps it as stored, "auto"
    is serve's default (`head_quantization`: int8 on the CPU for quantized checkpoints);
    kv_cache_dtype: `--kv-cache-dtype` (auto, fp8_e4m3fn, fp8_e5m2; models/kv_cache.py);
    kv_cache_fp8_skip_layers: `--kv-cache-fp8-skip-layers` (None: auto, measured at load).
    """
    device = device or torch.device("cpu")
    process_group = process_group or single_process_group()
    checkpoint = open_checkpoint(model)
    config_path = checkpoint.folder / "config.json"
    family, config = read_model_config(checkpoint.config, str(config_path), model_impl)
    torch_dtype = resolve_dtype(dtype, device, checkpoint.config)
    # Read once: every linear is then built by the loader this config selects. The
    # embedding and the head read their tensors directly, so they stay unquantized.
    kv_declaration = read_kv_cache_declaration(checkpoint.folder)  # first: a KV format we cannot read is named
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, kv_declaration, torch_dtype)
    if not is_fp8(kv_dtype) and parse_kv_skip_layers(kv_cache_fp8_skip_layers or "auto",
                                                     "--kv-cache-fp8-skip-layers") not in ("auto", "none"):
        raise ValueError(f"--kv-cache-fp8-skip-layers {kv_cache_fp8_skip_layers} names layers of an fp8 KV cache, "
                         f"but this cache is {str(kv_dtype).removeprefix('torch.')} (give --kv-cache-dtype fp8_e4m3fn "
                         "or fp8_e5m2, or leave the flag at auto)")
    qconfig = read_quantization_config(checkpoint.folder, quantize)
    if qconfig is not None and process_group.rank == 0:
        logger.info("quantization: {} (from {})", qconfig.describe(), qconfig.source)
    weights = Weights(tensor_source(checkpoint.folder), device, torch_dtype, process_group,
                      loader=get_loader(qconfig))
    progress = current_startup()
    if progress is not None:  # the live "loading weights n/N tensors" of `serve` (utils/progress.py)
        weights.source = CountingSource(weights.source, progress)
        progress.phase("loading weights", total=len(weights.tensor_names()), unit="tensors")
    if family is None:
        from text_generation_server.models import transformers_impl

        net = transformers_impl.build(checkpoint.config, weights, torch_dtype, str(config_path))
        impl = "transformers"
    else:
        family.prepare(config, weights)
        net = family.build(config, weights).eval()
        impl = "native"
    head_method, head_why = head_quantization(quantize_lm_head, qconfig, device)
    if head_method is not None:
        if process_group.rank == 0:
            logger.info("lm_head: {} ({})", head_method, head_why)
        quantize_head(net, head_method, torch_dtype, process_group.rank == 0)
    # Benchmarks only: canned logits in place of the forward, behind two env vars (engine/standin.py).
    net = standin_from_environment(net, checkpoint.tokenizer, checkpoint.eos_token_ids, device, process_group.rank)
    kv_scales = None
    if is_fp8(kv_dtype):
        layout = getattr(net, "kv_layout", None) or KVLayout(config.num_hidden_layers, net.local_kv_heads,
                                                             config.head_dim)
        kv_scales = layer_scales(net, weights, kv_declaration, layout, kv_dtype, device, process_group.rank == 0)
        kv_scales = skip_layers(kv_cache_fp8_skip_layers, net, checkpoint.tokenizer, layout, kv_scales, torch_dtype,
                                device, process_group, process_group.rank == 0)
    if process_group.rank == 0:
        logger.info(
            "loaded {} ({}, {} implementation, {} layers, hidden {}) as {} on {} with {} shard(s)",
            checkpoint.model_id, config.model_type, impl, config.num_hidden_layers, config.hidden_size,
            str(torch_dtype).removeprefix("torch."), device, process_group.size,
        )
    return CausalLM(
        model_id=checkpoint.model_id,
        model=net,
        tokenizer=checkpoint.tokenizer,
        eos_token_ids=checkpoint.eos_token_ids,
        device=device,
        dtype=torch_dtype,
        process_group=process_group,
        block_size=block_size,
        quantize=qconfig.flag if qconfig is not None else None,  # bitsandbytes-nf4, not just bitsandbytes
        attention_backend=attention_backend,
        cuda_graphs=cuda_graphs,
        max_batch_size=max_batch_size,
        graph_capturer=graph_capturer,
        model_impl=impl,
        kv_dtype=kv_dtype,
        kv_scales=kv_scales,
    )


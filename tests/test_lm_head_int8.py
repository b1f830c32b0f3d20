"""`--quantize-lm-head int8`: the dense head runs as per-row int8 on the int8 kernel; logits stay
within int8 rounding of the dense head's, at one rank and split by vocabulary over two."""

from __future__ import annotations

import pytest
import torch
from family_cases import write_family_checkpoint
from helpers import greedy, kernel_names, run_ranks

from text_generation_server.layers.tensor_parallel import QuantizedTensorParallelHead, TensorParallelHead
from text_generation_server.models.loader import get_model
from text_generation_server.settings.serve_args import ServeArgs


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("head")
    write_family_checkpoint(root / "qwen3", "qwen3", seed=7)
    return str(root / "qwen3")


def head_logits(lm, hidden: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model.head(hidden)


def test_int8_head_logits_are_the_int8_rounding_of_the_dense_head(folder):
    dense = get_model(folder, dtype="float32")
    quantized = get_model(folder, dtype="float32", quantize_lm_head="int8")
    assert isinstance(dense.model.head.projection, TensorParallelHead)
    projection = quantized.model.head.projection
    assert isinstance(projection, QuantizedTensorParallelHead)
    assert kernel_names(quantized)["head.projection.linear"] in ("cpu-int8", "reference")
    hidden = torch.randn(5, dense.config.hidden_size)
    want, got = head_logits(dense, hidden), head_logits(quantized, hidden)
    assert got.shape == want.shape == (5, dense.config.vocab_size)
    # Per-row int8: each weight within half a step (absmax / 254) of the dense one; the kernel
    # computes in bfloat16 (activations rounded too).
    w = dense.model.head.projection.weight
    bound = (w.abs().amax(dim=1) / 254 * hidden.abs().sum(dim=1, keepdim=True)) + 0.02 * want.abs() + 0.05
    assert ((got - want).abs() <= bound).all()
    assert not torch.equal(got, want)  # really quantized


def test_int8_head_keeps_greedy_tokens_nearly_always(folder):
    dense = greedy(get_model(folder, dtype="float32"), 12)
    quantized = greedy(get_model(folder, dtype="float32", quantize_lm_head="int8"), 12)
    same = sum(a == b for d, q in zip(dense, quantized) for a, b in zip(d, q))
    assert same >= 0.8 * sum(map(len, dense)), (dense, quantized)


def _rank_logits(pg, folder):
    lm = get_model(folder, dtype="float32", process_group=pg, quantize_lm_head="int8")
    torch.manual_seed(0)
    return head_logits(lm, torch.randn(3, lm.config.hidden_size))


def test_two_ranks_split_the_int8_head_by_vocabulary(folder, tmp_path, monkeypatch):
    from text_generation_server.kernels.select import CACHE_ENV
    from text_generation_server.quantizers.dist import single_process_group

    # Each rank's half of the head is another shape than the whole: choices this machine measured for
    # one and not the other (kernels/cpu_tuning.py) would round them differently. Static choices here.
    monkeypatch.setenv(CACHE_ENV, "off")

    one = _rank_logits(single_process_group(), folder)
    results = run_ranks(_rank_logits, (folder,), 2, tmp_path, 240)
    for logits in results:
        torch.testing.assert_close(logits, one, rtol=0, atol=1e-3)


def test_unknown_method_is_refused_by_name():
    with pytest.raises(ValueError, match="--quantize-lm-head must be one of int8"):
        ServeArgs(quantize_lm_head="int4").validate()


# -- the default: int8 on the CPU for quantized checkpoints ---------------------------------------
def test_the_default_head_is_int8_for_quantized_checkpoints_on_the_cpu():
    from text_generation_server.models.loader import head_quantization
    from text_generation_server.quantizers.config import GPTQConfig

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    four, eight = GPTQConfig(source="test", bits=4), GPTQConfig(source="test", bits=8)
    assert head_quantization("auto", four, cpu)[0] == "int8"
    assert head_quantization("auto", eight, cpu)[0] == "int8"
    assert "none" in head_quantization("auto", four, cpu)[1]  # the log line says how to switch it off
    assert head_quantization("auto", None, cpu)[0] is None  # dense checkpoints keep a dense head
    assert head_quantization("auto", four, cuda)[0] is None
    assert head_quantization("none", four, cpu)[0] is None and head_quantization(None, four, cpu)[0] is None
    assert head_quantization("int8", None, cpu)[0] == "int8"  # asked for: any checkpoint, any device


def test_serve_asks_for_the_default_and_none_switches_it_off(folder, tmp_path, monkeypatch):
    from helpers import write_checkpoint
    from test_quant_e2e import VARIANTS, write_variant

    from text_generation_server.settings.serve_args import LM_HEAD_AUTO

    ServeArgs(quantize_lm_head="none").validate()
    source = inspect_rank_source()
    assert "quantize_lm_head=args.quantize_lm_head or LM_HEAD_AUTO" in source
    write_checkpoint(tmp_path / "dense", "llama", seed=3, hidden_size=128, intermediate_size=256,
                     num_attention_heads=4, num_key_value_heads=2)
    write_variant(tmp_path / "dense", tmp_path / "q", tmp_path / "ref", VARIANTS["gptq-v1-4bit-g64-asym"], seed=1)
    quantized = get_model(str(tmp_path / "q"), dtype="bfloat16", quantize_lm_head=LM_HEAD_AUTO)
    assert isinstance(quantized.model.head.projection, QuantizedTensorParallelHead)
    assert quantized.model.head.projection.linear.kernel_name == "cpu-int8"
    kept = get_model(str(tmp_path / "q"), dtype="bfloat16", quantize_lm_head="none")
    assert isinstance(kept.model.head.projection, TensorParallelHead)
    dense = get_model(folder, dtype="bfloat16", quantize_lm_head=LM_HEAD_AUTO)
    assert isinstance(dense.model.head.projection, TensorParallelHead)


def inspect_rank_source() -> str:
    import inspect

    from text_generation_server.launcher import rank

    return inspect.getsource(rank)

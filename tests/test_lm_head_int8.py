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


def test_two_ranks_split_the_int8_head_by_vocabulary(folder, tmp_path):
    from text_generation_server.quantizers.dist import single_process_group

    one = _rank_logits(single_process_group(), folder)
    results = run_ranks(_rank_logits, (folder,), 2, tmp_path, 240)
    for logits in results:
        torch.testing.assert_close(logits, one, rtol=0, atol=1e-3)


def test_unknown_method_is_refused_by_name():
    with pytest.raises(ValueError, match="--quantize-lm-head must be one of int8"):
        ServeArgs(quantize_lm_head="int4").validate()

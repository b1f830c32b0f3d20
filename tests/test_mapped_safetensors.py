"""Safetensors files read as one private mapping (quantizers/sources.py): every tensor a view of it,
fused weights whose parts lie back to back a view too, the file never written, and malformed
entries still refused by name."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from text_generation_server.quantizers.sources import CheckpointError, SafetensorsSource, fused_view
from text_generation_server.quantizers.weights import Weights


def _weights(path, dtype=torch.bfloat16) -> Weights:
    return Weights(SafetensorsSource([path]), torch.device("cpu"), dtype)


def test_gate_and_up_fuse_as_a_view_of_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = {f"mlp.{n}.weight": torch.randn(24, 16).to(torch.bfloat16) for n in ("down_proj", "gate_proj", "up_proj")}
    tensors |= {f"attn.{n}.weight": torch.randn(16, 16).to(torch.bfloat16) for n in ("k_proj", "o_proj", "q_proj", "v_proj")}
    save_file(tensors, str(path))
    weights = _weights(path)
    gate, up = weights.get_tensor("mlp.gate_proj.weight"), weights.get_tensor("mlp.up_proj.weight")
    fused = weights.loader.get_multi_weights_col(weights, ["mlp.gate_proj", "mlp.up_proj"], 0).weight
    assert torch.equal(fused, torch.cat([tensors["mlp.gate_proj.weight"], tensors["mlp.up_proj.weight"]]))
    assert fused.data_ptr() == gate.data_ptr() and fused.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
    # q, k, v are stored k, o, q, v: not back to back in fusing order, so they are copied (and still right).
    qkv = weights.loader.get_multi_weights_col(weights, ["attn.q_proj", "attn.k_proj", "attn.v_proj"], 0).weight
    assert torch.equal(qkv, torch.cat([tensors[f"attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")]))
    assert qkv.untyped_storage().data_ptr() != gate.untyped_storage().data_ptr()
    # Out of order, or another dtype: copies.
    assert fused_view([up, gate], 0) is None
    assert fused_view([gate, up], 1) is None
    as_float = _weights(path, torch.float32)
    assert as_float.loader.get_multi_weights_col(as_float, ["mlp.gate_proj", "mlp.up_proj"], 0).weight.dtype == torch.float32


def test_a_written_weight_never_reaches_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(64, 64)}, str(path))
    before = path.read_bytes()
    w = _weights(path, torch.float32).get_tensor("w")
    w.add_(1.0)
    assert path.read_bytes() == before and w.sum().item() == 64 * 64


def test_windows_are_views_where_contiguous_and_copies_where_not(tmp_path):
    path = tmp_path / "model.safetensors"
    t = torch.arange(32 * 8, dtype=torch.float32).reshape(32, 8)
    save_file({"t": t}, str(path))
    source = SafetensorsSource([path])
    rows = source.get_slice("t")[4:12]
    cols = source.get_slice("t")[:, 2:5]
    assert torch.equal(rows, t[4:12]) and torch.equal(cols, t[:, 2:5]) and cols.is_contiguous()
    whole = source.get_slice("t")[...]
    assert rows.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def _rewrite_header(path, edit) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


def test_an_entry_past_the_end_of_the_file_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4, 4), "b": torch.ones(4, 4)}, str(path))
    _rewrite_header(path, lambda h: h["b"].update(data_offsets=[64, 4096]))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        _weights(path, torch.float32).get_tensor("b")


def test_a_file_cut_short_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4, 4)}, str(path))
    path.write_bytes(path.read_bytes()[:5])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        _weights(path, torch.float32).get_tensor("a")


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="page residency is read from /proc")
@pytest.mark.parametrize("madvise", [True, False])
def test_prefault_maps_every_weight_page_in(tmp_path, monkeypatch, madvise):
    from text_generation_server.engine import resident

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(1024, 1024), "b": torch.randn(512, 1024)}, str(path))
    weights = _weights(path, torch.float32)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(weights.get_tensor("a"), requires_grad=False)
    model.b = torch.nn.Parameter(weights.get_tensor("b"), requires_grad=False)
    params = [model.a, model.b]
    if not madvise:  # no MADV_POPULATE_READ: the fallback reads one element per page
        monkeypatch.setattr(resident, "_libc", lambda: None)
    before = resident.touched_bytes(params)
    covered = resident.prefault_weights(model)
    after = resident.touched_bytes(params)
    assert covered >= 6 * 2**20 and after is not None and after >= 6 * 2**20 > before

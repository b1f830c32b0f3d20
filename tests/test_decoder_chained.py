"""Decoder layers that hand their last residual add on to the next layer's norm (models/decoder.py,
`DecoderLayer.forward_chained`): one call fewer per layer on the CPU, and the same bits as adding at
each layer's end (issue #31: a small model's step on the CPU is mostly such calls)."""

from __future__ import annotations

from pathlib import Path

import pytest

from family_cases import write_family_checkpoint
from helpers import ids_request, random_ids
from text_generation_server import about
from text_generation_server.models import decoder
from text_generation_server.models.loader import get_model

EMBEDDED = Path(about.__file__).parent / "assets" / about.EMBEDDED_MODEL_ID


def decode_all(lm, vocab: int = 1000) -> list:
    """Greedy tokens and logprobs of three prompts of different lengths, decoded together."""
    lm.allocate_kv_cache(64)
    batch = lm.make_batch(0, [ids_request(i, random_ids(15 + 8 * i, i, vocab), 10) for i in range(3)])
    out = []
    while batch is not None:
        generations, batch, _ = lm.generate_token(batch)
        out.append([(g.request_id, g.tokens.ids, g.tokens.logprobs) for g in generations])
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_chained_layers_give_the_bits_of_adding_at_each_layer(monkeypatch, dtype):
    lm = get_model(str(EMBEDDED), dtype=dtype)
    calls = []
    chained = decoder.DecoderLayer.forward_chained

    def counting(self, hidden, pending, ctx):
        calls.append(pending is None)
        return chained(self, hidden, pending, ctx)

    monkeypatch.setattr(decoder.DecoderLayer, "forward_chained", counting)
    got = decode_all(lm)
    assert lm.model._chained is True
    layers = len(lm.model.layers)
    assert calls and len(calls) % layers == 0 and calls[::layers] == [True] * (len(calls) // layers)
    lm.model._chained = False  # every layer adds at its end, as before
    calls.clear()
    want = decode_all(lm)
    assert not calls and got == want


@pytest.mark.parametrize("name", ["phi", "gemma2"])
def test_layers_with_other_wiring_are_not_chained(tmp_path, name):
    """Parallel attention and MLP (Phi), post norms and Gemma's 1 + w norms (Gemma 2): each layer adds
    at its own end, as before."""
    write_family_checkpoint(tmp_path, name)
    lm = get_model(str(tmp_path), dtype="float32")
    decode_all(lm, vocab=250)
    assert lm.model._chained is False
    assert not any(layer.chains_residual() for layer in lm.model.layers)


def test_a_forward_hook_on_a_layer_sees_every_call(monkeypatch):
    """A hook on a layer (tests' fault injection, profilers) would miss `forward_chained`: with one
    registered, the layers are called as modules, and the tokens stay the same."""
    lm = get_model(str(EMBEDDED), dtype="float32")
    want = decode_all(lm)
    seen = []
    handle = lm.model.layers[1].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    try:
        got = decode_all(lm)
    finally:
        handle.remove()
    assert got == want and len(seen) == len(want)  # one call per step (the prefill's included)

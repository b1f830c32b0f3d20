"""`serve model.gguf` end to end: a tiny GGUF (quantized linears) through the launcher, a rank and
the router, answering the engine's own greedy tokens over gRPC.

Why here: in-process tests load GGUF files through get_model, but `serve` wraps the checkpoint's
tensor source to count its tensors for the startup line, and the GGUF loader must still find its
file behind that wrapper (it did not: every served GGUF failed to start).
"""

from __future__ import annotations

import pytest
from gguf_writer import write_gguf
from serve_client import client_stub, generate, request

from text_generation_server.engine.types import GenerationRequest
from text_generation_server.models.loader import get_model

gguf = pytest.importorskip("gguf")


def test_a_gguf_file_serves_the_engines_tokens(start_serve, tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", "qwen2", gguf.GGMLQuantizationType.Q8_0)
    prompt = "def add(a, b):"
    lm = get_model(str(path), dtype="float32")
    lm.allocate_kv_cache(16)
    (want,) = lm.generate([GenerationRequest(id=0, inputs=prompt, max_new_tokens=6, ignore_eos_token=True)])
    server = start_serve(path, "--dtype", "float32")
    server.wait_serving(timeout_s=240)
    got = generate(client_stub(server), request(prompt, max_new_tokens=6, ignore_eos_token=True))
    assert got.token_ids == want.token_ids
    assert "loading weights" in server.log_path.read_text()

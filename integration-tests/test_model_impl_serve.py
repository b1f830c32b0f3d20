"""Model families through `serve`: a native family and the transformers fallback, over real gRPC.

A Gemma 2 checkpoint (soft-caps, alternating windows) and a GLM-4 one (no native family:
transformers' modeling code over our paged cache) are served on 2 ranks; Info says which
implementation runs, and the tokens equal the same checkpoint in-process.
"""

from __future__ import annotations

import json

import pytest
from family_cases import write_family_checkpoint
from serve_client import client_stub, generate, request
from test_transformers_fallback import write_case

from text_generation_server.models.loader import get_model
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb

PROMPT = "def fibonacci(n):\n    if n < 2:"
NEW_TOKENS = 10


@pytest.mark.parametrize("kind", ["gemma2", "glm4"])
def test_served_on_two_ranks_with_its_implementation_reported(tmp_path, start_serve, kind):
    folder = tmp_path / kind
    if kind == "glm4":
        folder.mkdir()
        write_case(folder, "glm4", seed=3)
    else:
        write_family_checkpoint(folder, "gemma2", seed=3)
    impl = "transformers" if kind == "glm4" else "native"
    server = start_serve(folder, num_shard=2)
    server.wait_serving(timeout_s=180)
    stub = client_stub(server)
    info = stub.Info(cpb.InfoRequest(), timeout=10)
    assert info.model_impl == impl and info.num_shard == 2
    assert f"{impl} implementation" in server.log()
    served = generate(stub, request(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos_token=True))
    local = get_model(str(folder), dtype="float32").generate(
        [GenerationRequest(id=0, inputs=PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos_token=True)])[0]
    assert list(served.token_ids) == local.token_ids
    assert json.loads((folder / "config.json").read_text())["model_type"] == kind


def test_native_refuses_a_type_it_does_not_implement(tmp_path, start_serve):
    folder = tmp_path / "glm4"
    folder.mkdir()
    write_case(folder, "glm4", seed=4)
    server = start_serve(folder, "--model-impl", "native")
    code = server.wait_exit(120)
    assert code != 0 and "model_type 'glm4' is not supported" in server.log()

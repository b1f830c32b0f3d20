"""`serve --speculate 2` against `serve`: the same text, every token streamed, accepted tokens counted.

Two real servers of the embedded model run side by side: one speculating on two tensor-parallel
ranks (so the per-position logits of a speculative step are gathered across ranks in step) and
one plain. The same requests (repetitive code, plain prompts, seeded sampling, a stop sequence,
concurrent streams) go to both through the client gRPC API; every answer must be identical, a
stream must carry one message per generated token, and /metrics must show accepted speculative
tokens (tgi_request_skipped_tokens) on the speculating server only.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_client import client_stub, collect_stream, generate, launch_serve, request, scrape, shard_stub

from text_generation_server.about import EMBEDDED_MODEL_ID
from text_generation_server.pb.generate.v3 import generate_pb2 as spb

REPETITIVE = [
    "import os\nimport sys\n",
    ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n\n"
     "class Size:\n    def __init__(self, width, height):\n"),
    ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
     "def factorial(n):\n"),
]
PLAIN = ["x = ", "with open(path) as f:"]
NEW = 40


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    sock_dir = tmp_path_factory.mktemp("sock")
    log_dir = tmp_path_factory.mktemp("logs")
    spec = launch_serve(EMBEDDED_MODEL_ID, sock_dir, log_dir, "--speculate", "2", num_shard=2, name="spec")
    plain = launch_serve(EMBEDDED_MODEL_ID, sock_dir, log_dir, name="plain")
    try:
        spec.wait_serving(timeout_s=180)
        plain.wait_serving(timeout_s=180)
        yield spec, plain
    finally:
        spec.cleanup()
        plain.cleanup()


def cases() -> dict[str, object]:
    out = {f"repetitive{i}": request(p, max_new_tokens=NEW) for i, p in enumerate(REPETITIVE)}
    out.update({f"plain{i}": request(p, max_new_tokens=NEW) for i, p in enumerate(PLAIN)})
    out["seeded"] = request(REPETITIVE[1], max_new_tokens=NEW, do_sample=True, seed=42, temperature=0.6,
                            top_k=40, repetition_penalty=1.1)
    out["stopped"] = request(REPETITIVE[0], max_new_tokens=NEW, stop=["os\nimport os\nimport"])
    return out


def test_speculation_gives_the_same_text_and_streams_every_token(servers):
    spec, plain = servers
    spec_stub, plain_stub = client_stub(spec), client_stub(plain)
    for name, req in cases().items():
        want = generate(plain_stub, req)
        got = generate(spec_stub, req)
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason), name
        req.parameters.details = True
        messages = collect_stream(spec_stub, req)
        assert [m.token.id for m in messages] == want.token_ids, name
        assert len(messages) == messages[-1].details.generated_tokens, name
        assert messages[-1].generated_text == want.text
        assert not any(m.HasField("generated_text") for m in messages[:-1])
    # Concurrent streams share speculative steps with rows that have nothing to propose.
    reqs = list(cases().values())
    with ThreadPoolExecutor(len(reqs)) as pool:
        together = list(pool.map(lambda r: [m.token.id for m in collect_stream(spec_stub, r)], reqs))
    assert together == [generate(plain_stub, r).token_ids for r in reqs]


def test_accepted_tokens_are_counted_and_info_says_speculate(servers):
    spec, plain = servers
    for server in servers:
        generate(client_stub(server), request(REPETITIVE[0], max_new_tokens=NEW))
    skipped = scrape(spec).value("tgi_request_skipped_tokens_sum", None)
    assert skipped > 0, "no speculative token was accepted on repetitive code"
    assert scrape(spec).value("tgi_request_skipped_tokens_count", None) > 0
    assert scrape(plain).value("tgi_request_skipped_tokens_sum", None) == 0
    assert shard_stub(spec).Info(spb.InfoRequest(), timeout=10).speculate == 2
    assert shard_stub(plain).Info(spb.InfoRequest(), timeout=10).speculate == 0
    assert "speculation: up to 2 n-gram tokens" in spec.log()

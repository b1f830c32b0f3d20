"""Chains of steps ahead through real `serve` processes (shard/service.py, TGS_DECODE_AHEAD_STEPS).

With the benchmark-only stand-in forward at X = 0 (engine/standin.py: canned logits at no cost)
the router is slower than a step, so the rank chains steps whenever the router lags (how often
depends on the machine's load). A server with chains of 8 and one with chains of 1 get the same concurrent workload:
every stream, every text, finish and token count must be the same on both, one message per
token; the server with chains of 1 shows one step per Decode call in /metrics. A third server
runs its rank inside the router's process (`--shard-in-process`), whose calls chain too.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_client import client_stub, collect_stream, launch_serve, request, scrape

from text_generation_server.engine.standin import ACK_ENV, ACK_VALUE, FORWARD_US_ENV
from text_generation_server.shard.service import AHEAD_STEPS_ENV

STANDIN = {FORWARD_US_ENV: "0", ACK_ENV: ACK_VALUE}
PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Node:\n    def __init__(self", "for i in range(",
           "with open(path) as f:", "return sorted(", "try:\n    import", "def main():\n    args ="]
NEW = [3, 9, 17, 30, 41, 50, 64, 64]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    sock_dir, log_dir = tmp_path_factory.mktemp("sock"), tmp_path_factory.mktemp("logs")
    chained = launch_serve(None, sock_dir, log_dir, name="chained", env={**STANDIN, AHEAD_STEPS_ENV: "8"})
    single = launch_serve(None, sock_dir, log_dir, name="single", env={**STANDIN, AHEAD_STEPS_ENV: "1"})
    local = launch_serve(None, sock_dir, log_dir, "--shard-in-process", name="local",
                         env={**STANDIN, AHEAD_STEPS_ENV: "8"})
    try:
        for server in (chained, single, local):
            server.wait_serving(timeout_s=120)
        yield chained, single, local
    finally:
        for server in (chained, single, local):
            server.cleanup()


def view(messages):
    last = messages[-1]
    return ([m.token.id for m in messages], [m.token.text for m in messages], last.generated_text,
            last.details.finish_reason, last.details.generated_tokens,
            sum(m.HasField("generated_text") for m in messages))


def workload(server, stop: str | None) -> list:
    stub = client_stub(server)
    reqs = [request(p, max_new_tokens=n, details=True) for p, n in zip(PROMPTS, NEW)]
    if stop is not None:
        reqs.append(request(PROMPTS[0], max_new_tokens=64, details=True, stop=[stop]))
    with ThreadPoolExecutor(len(reqs)) as pool:
        return [view(m) for m in pool.map(lambda r: collect_stream(stub, r), reqs)]


def decode_counts(server) -> tuple[float, float]:
    snap = scrape(server)
    return (snap.value("tgi_batch_forward_duration_count", method="decode"),
            snap.value("tgi_batch_inference_duration_count", method="decode"))


def test_chained_answers_stream_as_steps_one_by_one(servers):
    chained, single, local = servers
    plain = workload(single, None)
    # A stop sequence in the middle of the first stream's canned text: it ends inside a chain.
    text = plain[0][2]
    stop = text[len(text) // 2: len(text) // 2 + 4]
    for round_ in range(3):
        want = workload(single, stop)
        got = workload(chained, stop)
        assert got == want, f"round {round_}"
        assert workload(local, stop) == want, f"round {round_}, in-process"
    for (ids, _, text, _, generated, finishes), n in zip(want, NEW + [64]):
        assert finishes == 1 and len(ids) == generated
    assert [len(v[0]) for v in want[:-1]] == NEW
    assert len(want[-1][0]) < 64 and want[-1][2].endswith(stop)
    for server in (chained, local):
        steps, calls = decode_counts(server)
        # Whether answers held chains depends on how far the router lags behind a free step: on a
        # busy machine 1.2-3x more steps than calls, on a quiet one as few as none (tests/test_decode_chain.py
        # forces chains of known length). Never fewer steps than calls.
        assert steps >= calls > 0, (steps, calls)
    steps, calls = decode_counts(single)
    assert steps == calls, (steps, calls)

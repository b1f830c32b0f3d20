"""Soak: hundreds of requests at concurrency 64 on the embedded model, bounded in time.

Every response must equal the same request's answer when it ran alone (greedy decoding
is deterministic whatever else shares the batch), nothing may fail, the KV cache must be
empty at the end, and the resident memory of the serve process tree (launcher + rank)
may grow by at most RSS_GROWTH_BOUND_MIB between the end of warm-up and the end of the
soak. The test prints its figures (they go into BENCHMARKS.md). It checks consistency
only, never the model's exact text, so a retrained embedded model passes unchanged.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import children_of
from serve_client import (
    CORPUS, Completion, client_stub, generate, launch_serve, poll_metrics, request, scrape, stream_completion,
)

REQUESTS = 960
CONCURRENCY = 64
RSS_GROWTH_BOUND_MIB = 200  # also stated in the README's promises
RPC_TIMEOUT_S = 120.0  # per request: bounds the whole test even when something hangs
PROMPTS = [
    "def fibonacci(", "import os\n", "class Stack:\n    def", "for i in range(", "# sort a list\ndef",
    "The quick brown fox", "def add(a, b):\n    return", "x = [", "while True:\n   ", "print(",
]


def _cases() -> list[tuple[str, int]]:
    """40 distinct (prompt, max_new_tokens) pairs: varied prompt lengths and generation lengths."""
    cases = []
    for i in range(40):
        base = PROMPTS[i % len(PROMPTS)]
        prompt = base if i < 10 else CORPUS[(13 * i) % 200:][: 5 + (i * 7) % 60] + base
        cases.append((prompt, 4 + (i * 5) % 21))  # 4..24 new tokens
    return cases


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def tree_rss_mib(root: int) -> float:
    """Resident memory of a process and all its descendants."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children_of(pid)
    return sum(_rss_kib(p) for p in pids) / 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = launch_serve(None, tmp_path_factory.mktemp("sock"), tmp_path_factory.mktemp("logs"),
                        "--max-batch-total-tokens", "8192", "--max-concurrent-requests", "128", name="soak")
    try:
        proc.wait_serving(timeout_s=180)
        yield proc
    finally:
        proc.cleanup()


def test_soak_at_concurrency_64(server, capsys):
    stub = client_stub(server)
    cases = _cases()
    reqs = [request(prompt, max_new_tokens=n) for prompt, n in cases]
    alone = [generate(stub, r, timeout=RPC_TIMEOUT_S) for r in reqs]  # one at a time: nothing else in the batch
    assert all(a.token_ids for a in alone)

    def run(i: int) -> Completion | Exception:
        req = reqs[i % len(reqs)]
        try:  # both RPCs, so each is checked under load
            if i % 2:
                return stream_completion(stub, req, timeout=RPC_TIMEOUT_S)
            return generate(stub, req, timeout=RPC_TIMEOUT_S)
        except Exception as exc:  # reported below with the request it belongs to
            return exc

    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        warm = list(pool.map(run, range(CONCURRENCY)))  # warm-up: one full round at the target concurrency
        assert [w for w in warm if isinstance(w, Exception)] == []
        poll_metrics(server, lambda s: s.value("tgs_kv_blocks_used", None) == 0)
        before = scrape(server)
        rss_before = tree_rss_mib(server.pid)
        started = time.monotonic()
        results = list(pool.map(run, range(REQUESTS)))
        wall = time.monotonic() - started
    rss_after = tree_rss_mib(server.pid)

    errors = [(i, r) for i, r in enumerate(results) if isinstance(r, Exception)]
    assert not errors, f"{len(errors)} of {REQUESTS} failed; first: {errors[0]}"
    mismatched = [i for i, r in enumerate(results) if r != alone[i % len(reqs)]]
    assert not mismatched, f"{len(mismatched)} responses differ from their single-request result; " \
                           f"first: case {mismatched[0] % len(reqs)} {cases[mismatched[0] % len(reqs)]}"

    after = poll_metrics(server, lambda s: s.value("tgs_kv_blocks_used", None) == 0)
    assert after.value("tgi_queue_size", None) == 0 and after.value("tgi_batch_current_size", None) == 0
    assert after.value("tgi_request_success_total") - before.value("tgi_request_success_total") == REQUESTS
    for family in ("tgi_request_failure_total", "tgs_request_cancelled_total"):
        assert sum(v for (name, _), v in after.samples.items() if name == family) == 0, f"{family} is not zero"
    prefills = after.value("tgi_batch_next_size_count") - before.value("tgi_batch_next_size_count")
    tokens = sum(len(r.token_ids) for r in results)
    growth = rss_after - rss_before
    with capsys.disabled():
        print(f"\nsoak: {REQUESTS} requests at concurrency {CONCURRENCY} on the embedded model in {wall:.1f} s: "
              f"{REQUESTS / wall:.1f} req/s, {tokens / wall:.0f} generated tokens/s ({tokens} tokens), "
              f"{prefills:.0f} prefill batches (mean {REQUESTS / max(prefills, 1):.1f} requests); "
              f"RSS of serve + rank {rss_before:.0f} -> {rss_after:.0f} MiB ({growth:+.1f} MiB, "
              f"bound {RSS_GROWTH_BOUND_MIB} MiB); {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    assert growth < RSS_GROWTH_BOUND_MIB, f"resident memory grew by {growth:.0f} MiB"

"""Prefix caching and chunked prefill through real `serve` processes: exact, and visible in /metrics.

For each setup (the embedded model on two ranks; a GPTQ checkpoint written by our `quantize`)
two servers run side by side, one with --prefix-caching and one with --no-prefix-caching, both
with a prefill budget of 32 tokens (so every prompt here is chunked) and a KV cache of 400
tokens (so cached prefixes are evicted). The same workload goes to both: a shared system
prompt, a partial-block prefix, a follow-up turn containing the previous answer, a seeded
sampled request (twice), a stop sequence, a cancelled stream, concurrent requests, then enough
distinct long prompts to evict, and the first requests again. Every answer must be identical
on both servers, token for token; greedy answers must also equal the same prompt generated
alone in this process (no cache, no chunks). The tests of a module run in file order: the
metrics test reads what the workload left.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import ServeProcess, clean_env
from serve_client import CORPUS, client_stub, generate, launch_serve, poll_metrics, request, scrape

from text_generation_server.about import EMBEDDED_MODEL_ID
from text_generation_server.models.loader import get_model
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb

FLAGS = ["--max-batch-prefill-tokens", "32", "--max-batch-total-tokens", "400", "--max-total-tokens", "256",
         "--max-input-tokens", "200"]
SYSTEM = ("# Helpers for reading configuration files.\nimport os\nimport sys\nimport json\n\n"
          "DEFAULTS = {'debug': False, 'verbose': True}\n\n")
QUESTIONS = ["def load(path):", "class Config:\n    def __init__(self", "def main():\n    args =",
             "def parse_args(argv):", "def merge(a, b):"]
NEW = 10
CONCURRENT_NEW = 64  # 5 x (about 50 prompt + 64) tokens: more than the 400-token KV cache
LONG_TEXT = CORPUS * 3


def quantize_cli(model: str, out: Path, *flags: str) -> None:
    exe = Path(sys.executable).parent / "text-generation-server"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "text_generation_server.cli"]
    done = subprocess.run(cmd + ["quantize", model, str(out), *flags], capture_output=True, text=True, timeout=180,
                          env=clean_env())
    assert done.returncode == 0, done.stderr[-4000:]


@dataclass
class Servers:
    model: str
    num_shard: int
    on: ServeProcess  # --prefix-caching
    off: ServeProcess  # --no-prefix-caching
    answers: dict = field(default_factory=dict)  # "on"/"off" -> {name: Completion}
    deltas: dict = field(default_factory=dict)  # "on"/"off" -> prefix-cache hits counted over the shared-prefix request


@pytest.fixture(scope="module", params=["two-shards", "gptq"])
def servers(request, tmp_path_factory):
    """Both servers of one setup, started together (their startups overlap)."""
    if request.param == "two-shards":
        model, num_shard = EMBEDDED_MODEL_ID, 2
    else:
        out = tmp_path_factory.mktemp("quant") / "pycoder-gptq"
        # hidden 256, MLP 768: groups of 32 divide both (and their halves, were it sharded)
        quantize_cli(EMBEDDED_MODEL_ID, out, "--bits", "4", "--groupsize", "32", "--nsamples", "8", "--seqlen", "64",
                     "--logger-level", "WARNING")
        model, num_shard = str(out), 1
    sock_dir = tmp_path_factory.mktemp("sock")
    log_dir = tmp_path_factory.mktemp("logs")
    # The head as stored (the reference's): serve's default int8 head for a quantized checkpoint takes
    # other kernels at other decode batch sizes, and the concurrent requests compare batched answers
    # with answers computed alone (tests/test_lm_head_int8.py covers that head).
    flags = (*FLAGS, "--quantize-lm-head", "none")
    on = launch_serve(model, sock_dir, log_dir, *flags, "--prefix-caching", num_shard=num_shard, name="on")
    off = launch_serve(model, sock_dir, log_dir, *flags, "--no-prefix-caching", num_shard=num_shard, name="off")
    try:
        on.wait_serving(timeout_s=120)
        off.wait_serving(timeout_s=120)
        yield Servers(model, num_shard, on, off)
    finally:
        on.cleanup()
        off.cleanup()


@pytest.fixture(scope="module")
def reference(servers):
    """Greedy answers of prompts generated alone in this process: no prefix cache, no chunks."""
    torch.set_num_threads(1)
    return Reference(get_model(servers.model))


class Reference:
    def __init__(self, lm):
        self.lm = lm

    def completion(self, prompt: str, max_new_tokens: int = NEW):
        return self.lm.generate([GenerationRequest(id=0, inputs=prompt, max_new_tokens=max_new_tokens)])[0]

    def __call__(self, prompt: str, max_new_tokens: int = NEW) -> list[int]:
        return self.completion(prompt, max_new_tokens).token_ids


def _partial_prefix(text: str) -> str:
    """The system prompt cut inside a block: whole blocks are shared, the rest is not."""
    return text[: len(text) * 2 // 3]


def workload(server: ServeProcess, stop: str) -> tuple[dict[str, object], float]:
    """The same calls, in the same order, on either server; returns the answers and the prefix-cache
    hits counted while the second request over the shared system prompt ran."""
    stub = client_stub(server)
    out: dict[str, object] = {}
    out["first"] = generate(stub, request(SYSTEM + QUESTIONS[0], max_new_tokens=NEW))
    before = scrape(server).value("tgs_prefix_cache_hits_total", None)
    out["shared"] = generate(stub, request(SYSTEM + QUESTIONS[1], max_new_tokens=NEW))
    hits = scrape(server).value("tgs_prefix_cache_hits_total", None) - before
    out["partial"] = generate(stub, request(_partial_prefix(SYSTEM) + QUESTIONS[2], max_new_tokens=NEW))
    follow = SYSTEM + QUESTIONS[0] + out["first"].text + "\n\n" + QUESTIONS[3]
    out["follow-up"] = generate(stub, request(follow, max_new_tokens=NEW))
    seeded = request(SYSTEM + QUESTIONS[1], max_new_tokens=NEW, do_sample=True, seed=42, temperature=0.8, top_k=20)
    out["seeded"] = generate(stub, seeded)
    out["seeded-again"] = generate(stub, seeded)  # now its whole prompt is cached
    out["stop"] = generate(stub, request(SYSTEM + QUESTIONS[0], max_new_tokens=NEW, stop=[stop]))

    # A stream cancelled after two tokens: its blocks come back, nothing it computed is reused wrongly.
    # Long enough that the server cannot finish it before the cancel arrives (the stream runs ahead of
    # the reads: 40 tokens sometimes all went out first, and a finished request is not cancelled).
    forced = request(SYSTEM + QUESTIONS[4], max_new_tokens=180, details=True)
    stream = stub.GenerateStream(forced, timeout=60)
    out["cancelled"] = [next(stream).token.id, next(stream).token.id]
    stream.cancel()

    # Concurrent requests over the shared prefix, more than the KV cache holds at once: some wait.
    prompts = [SYSTEM + q for q in QUESTIONS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: generate(stub, request(p, max_new_tokens=CONCURRENT_NEW)), prompts))
    for i, answer in enumerate(together):
        out[f"concurrent-{i}"] = answer

    # Distinct long prompts fill the 25-block cache; the first requests run again over evicted blocks.
    for i in range(4):
        start = 37 * i + 11
        out[f"long-{i}"] = generate(stub, request(LONG_TEXT[start:start + 330], max_new_tokens=4))
    out["first-again"] = generate(stub, request(SYSTEM + QUESTIONS[0], max_new_tokens=NEW))
    out["follow-up-again"] = generate(stub, request(follow, max_new_tokens=NEW))
    return out, hits


def test_info_reports_prefix_caching_and_chunked_prefill(servers):
    for server, caching in ((servers.on, True), (servers.off, False)):
        info = client_stub(server).Info(cpb.InfoRequest(), timeout=10)
        assert info.prefix_caching is caching and info.chunked_prefill
        assert (info.num_shard, info.max_batch_prefill_tokens) == (servers.num_shard, 32)
        assert info.max_batch_total_tokens <= 400
        if servers.model != EMBEDDED_MODEL_ID:
            assert info.quantize.startswith("gptq"), info.quantize


def test_same_answers_with_and_without_prefix_caching(servers, reference):
    stop = reference.completion(SYSTEM + QUESTIONS[0]).text[2:6]
    assert stop.strip(), "the reference answer gives no usable stop sequence"
    with ThreadPoolExecutor(2) as pool:  # the two servers run their workloads at the same time
        on, off = pool.map(lambda s: workload(s, stop), (servers.on, servers.off))
    servers.answers = {"on": on[0], "off": off[0]}
    servers.deltas = {"on": on[1], "off": off[1]}
    answers_on, answers_off = on[0], off[0]
    assert answers_on.keys() == answers_off.keys()
    for name in answers_on:
        assert answers_on[name] == answers_off[name], name

    # Greedy answers are those of the prompt alone, computed whole, in this process.
    for name in ("first", "shared", "partial", "follow-up", "first-again", "follow-up-again"):
        assert answers_on[name].token_ids == reference(_prompt_of(name, answers_on)), name
    for i, q in enumerate(QUESTIONS):
        assert answers_on[f"concurrent-{i}"].token_ids == reference(SYSTEM + q, CONCURRENT_NEW), q
    assert answers_on["first-again"] == answers_on["first"]
    assert answers_on["seeded"] == answers_on["seeded-again"]
    assert answers_on["stop"].finish_reason == cpb.FINISH_REASON_STOP_SEQUENCE
    assert stop in answers_on["stop"].text
    assert answers_on["cancelled"] == reference(SYSTEM + QUESTIONS[4], 2)


def _prompt_of(name: str, answers: dict) -> str:
    follow = SYSTEM + QUESTIONS[0] + answers["first"].text + "\n\n" + QUESTIONS[3]
    return {"first": SYSTEM + QUESTIONS[0], "shared": SYSTEM + QUESTIONS[1],
            "partial": _partial_prefix(SYSTEM) + QUESTIONS[2], "follow-up": follow,
            "first-again": SYSTEM + QUESTIONS[0], "follow-up-again": follow}[name]


def test_metrics_show_hits_evictions_chunks_and_no_block_held(servers):
    assert servers.answers, "the workload test did not run"
    assert servers.deltas["on"] >= 1 and servers.deltas["off"] == 0
    # Idle: every block a request held is back (cached prefixes are not held).
    on = poll_metrics(servers.on, lambda m: m.value("tgs_kv_blocks_used", None) == 0
                      and m.value("tgs_request_cancelled_total", None) >= 1)
    off = poll_metrics(servers.off, lambda m: m.value("tgs_kv_blocks_used", None) == 0)
    assert on.value("tgs_prefix_cache_hits_total", None) >= 5  # shared, follow-up, seeded twice, stop, concurrent...
    assert on.value("tgs_prefix_cache_hit_tokens_total", None) >= 16 * on.value("tgs_prefix_cache_hits_total", None)
    assert on.value("tgs_prefix_cache_evictions_total", None) > 0
    assert on.value("tgs_prefix_cache_blocks", None) > 0
    assert off.value("tgs_prefix_cache_hits_total", None) == 0
    assert off.value("tgs_prefix_cache_hit_tokens_total", None) == 0
    assert off.value("tgs_prefix_cache_evictions_total", None) == 0
    for snap in (on, off):
        assert snap.value("tgs_chunked_prefills_total", None) > 0
        assert snap.value("tgs_prefill_chunks_total", None) > snap.value("tgs_chunked_prefills_total", None)
    # The cache saved prompt work: fewer prompt tokens were computed with it on.
    assert on.value("tgs_prompt_tokens_total", None) < off.value("tgs_prompt_tokens_total", None)

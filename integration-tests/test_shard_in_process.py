"""`serve --shard-in-process`: the one rank's model inside the launcher's process, as a real
server over real sockets. It must answer exactly what the default (a rank process behind its
unix socket) answers, count the same metrics, drain on SIGTERM, start no other process, and
refuse what it cannot do (several ranks, --shard-only, a broken model) by name.
"""

from __future__ import annotations

import json
import signal

from conftest import children_of
from serve_client import client_stub, generate, long_greedy_prompt, request, scrape, stream_completion

from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox", "class Stack:"]


def test_the_same_tokens_and_metrics_as_a_rank_process(tiny_model, start_serve):
    apart = start_serve(tiny_model)
    inside = start_serve(tiny_model, "--shard-in-process")
    apart.wait_serving(timeout_s=120)
    inside.wait_serving(timeout_s=120)
    assert children_of(inside.pid) == [], "no rank process: the model is in the launcher"
    assert "starting the rank in this process (--shard-in-process)" in inside.log()
    stub_apart, stub_inside = client_stub(apart), client_stub(inside)
    info = stub_inside.Info(cpb.InfoRequest(), timeout=10)
    assert info.num_shard == 1
    assert info.kernels == stub_apart.Info(cpb.InfoRequest(), timeout=10).kernels
    for prompt in PROMPTS:
        req = request(prompt, max_new_tokens=20, details=True)
        expected = generate(stub_apart, req)
        assert generate(stub_inside, req) == expected, prompt
        assert stream_completion(stub_inside, req) == expected, prompt
    seeded = request("def parse(", max_new_tokens=16, do_sample=True, seed=7, temperature=0.8)
    assert generate(stub_inside, seeded) == generate(stub_apart, seeded)
    snap = scrape(inside)
    assert snap.value("tgi_request_success_total", finish_reason="length") >= 2 * len(PROMPTS)
    assert snap.value("tgi_batch_inference_duration_count", method="decode") > 0


def test_sigterm_drains_a_running_stream(tiny_model, start_serve):
    server = start_serve(tiny_model, "--shard-in-process")
    server.wait_serving(timeout_s=120)
    stub = client_stub(server)
    prompt = long_greedy_prompt(stub, min_tokens=60)
    reference = generate(stub, request(prompt, max_new_tokens=200))
    params = cpb.GenerateParameters(max_new_tokens=200, details=True)
    stream = stub.GenerateStream(cpb.GenerateRequest(inputs=prompt, parameters=params), timeout=60)
    messages = [next(stream)]
    server.proc.send_signal(signal.SIGTERM)
    messages += list(stream)
    assert messages[-1].generated_text == reference.text
    assert len(messages) == len(reference.token_ids)
    assert server.wait_exit(30) == 0
    assert "received SIGTERM" in server.log()


def test_refusals_name_what_is_wrong(tiny_model, tmp_path, start_serve):
    two = start_serve(tiny_model, "--shard-in-process", "--num-shard", "2", limits=False)
    assert two.wait_exit(30) == 2
    assert "--shard-in-process runs one rank; --num-shard is 2" in two.log()
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{}")
    server = start_serve(broken, "--shard-in-process", "--json-output")
    assert server.wait_exit(60) != 0
    records = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    assert any(r["level"] == "ERROR" and str(broken / "config.json") in r["message"] for r in records), \
        server.log()[-2000:]

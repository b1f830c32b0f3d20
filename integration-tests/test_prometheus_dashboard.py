"""TGI's Grafana dashboard against a real Prometheus scraping a real `serve`; then the router's
reflection (v1 and v1alpha), health List, and health following a rank that stops answering,
on the same server.

Prometheus (Debian's package, see prometheus_server.py) scrapes /metrics every second with
`container="tgs"`, the label TGI's dashboard selects its service by. After a short load
through the gRPC client API, every query of the dashboard (tests/data/tgi_grafana_queries.json)
is evaluated through Prometheus's HTTP API and must give what its `expect` says.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import reflection_v1_client
from conftest import free_port
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_server import SCRAPE_INTERVAL, PrometheusServer, find_prometheus
from serve_client import (
    CORPUS, client_stub, collect_stream, generate, launch_serve, long_greedy_prompt, poll_metrics, request, rpc_error,
    scrape,
)

from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb

DASHBOARD = json.loads((Path(__file__).resolve().parents[1] / "tests" / "data" / "tgi_grafana_queries.json")
                       .read_text())
SERVICE_LABEL = "tgs"
SERVICE_NAME = cpb.DESCRIPTOR.services_by_name["TextGeneration"].full_name
LONG_REQUESTS, SHORT_REQUESTS = 12, 8  # with --max-batch-size 2: a queue that lasts a few scrapes
# The router checks every shard's Health every 5 s with a 5 s deadline (its defaults).
HEALTH_DETECTION_S = 5.0 + 5.0 + 10.0


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    proc = launch_serve(tiny_model, tmp_path_factory.mktemp("sock"), tmp_path_factory.mktemp("logs"),
                        "--max-batch-size", "2")
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    prom = PrometheusServer(find_prometheus(), tmp_path_factory.mktemp("prometheus"), free_port(),
                            [f"127.0.0.1:{server.metrics_port}"], {"container": SERVICE_LABEL})
    try:
        prom.wait_ready()
        yield prom
    finally:
        prom.stop()


def _run(stub, req: cpb.GenerateRequest, stream: bool) -> int:
    if stream:
        return len(collect_stream(stub, req))
    return len(generate(stub, req).token_ids)


@pytest.fixture(scope="module")
def loaded(server, prometheus):
    """Prometheus saw the server idle, then a burst of requests, then the server idle again."""
    deadline = time.monotonic() + 30
    while not (targets := prometheus.api("targets")["activeTargets"]) and time.monotonic() < deadline:
        time.sleep(0.1)  # the scrape manager starts a moment after /-/ready
    assert len(targets) == 1 and targets[0]["labels"]["container"] == SERVICE_LABEL, targets
    prometheus.wait_for(f'tgi_request_count{{container="{SERVICE_LABEL}"}}', lambda r: len(r) == 1)

    stub = client_stub(server)
    long_prompt = long_greedy_prompt(stub, min_tokens=150, max_new_tokens=200)
    jobs = [(request(long_prompt, max_new_tokens=200), i % 2 == 0) for i in range(LONG_REQUESTS)]
    jobs += [(request(CORPUS[i * 7:i * 7 + 40], max_new_tokens=16), i % 2 == 1) for i in range(SHORT_REQUESTS)]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        tokens = list(pool.map(lambda job: _run(stub, *job), jobs))
    assert all(tokens)
    # The burst may all be admitted in one prefill (then nothing is ever concatenated): one more
    # request arrives while another decodes, which the router must concatenate.
    running = stub.GenerateStream(request(long_prompt, max_new_tokens=40), timeout=120)
    next(running)
    assert _run(stub, request(CORPUS[:40], max_new_tokens=4), False)
    assert sum(1 for _ in running) > 0
    invalid = rpc_error(stub.Generate, request("x", max_new_tokens=10, temperature=-1.0), timeout=30)
    assert invalid.code() == grpc.StatusCode.INVALID_ARGUMENT

    final = poll_metrics(server, lambda s: s.value("tgs_kv_blocks_used", None) == 0)
    successes = final.value("tgi_request_success_total")
    assert successes >= len(jobs)
    prometheus.wait_for(f'sum(tgi_request_success{{container="{SERVICE_LABEL}"}})',
                        lambda r: r and float(r[0]["value"][1]) == successes)
    # The refused request came after the last success: a scrape can show every success and not it yet.
    refused = final.value("tgi_request_failure_total", err="validation")
    assert refused >= 1
    prometheus.wait_for(f'sum(tgi_request_failure{{container="{SERVICE_LABEL}",err="validation"}})',
                        lambda r: r and float(r[0]["value"][1]) == refused)
    return final


def _values(result: list[dict]) -> list[float]:
    return [float(r["value"][1]) for r in result]


def test_every_tgi_dashboard_query_answers(prometheus, loaded):
    failures = []
    for q in DASHBOARD["queries"]:
        expr = q["expr"].replace("$service", SERVICE_LABEL)
        if q["expect"] == "seen":
            expr = f"max_over_time(({expr})[10m:{SCRAPE_INTERVAL}])"  # every scrape's value
        values = _values(prometheus.query(expr))
        ok = {
            "positive": any(v > 0 for v in values),
            "seen": any(v > 0 for v in values),
            "zero": bool(values) and all(v == 0 for v in values),
        }[q["expect"]]
        if not ok:
            failures.append(f"#{q['id']} {q['panel']!r} expects {q['expect']}: {expr} -> {values}")
    assert not failures, "\n".join(failures)


def test_scrape_is_healthy_and_counters_are_typed_counters(prometheus, loaded):
    [target] = prometheus.api("targets")["activeTargets"]
    assert target["health"] == "up" and target["lastError"] == "", target
    # The dashboard's variable: label_values(tgi_request_count, container)
    assert prometheus.api("label/container/values", **{"match[]": "tgi_request_count"}) == [SERVICE_LABEL]
    metadata = prometheus.api("metadata")
    for name in ("tgi_request_count", "tgi_request_count_total", "tgi_request_failure", "tgi_batch_concat",
                 "tgi_batch_inference_count", "tgs_prompt_tokens"):
        assert metadata[name][0]["type"] == "counter", (name, metadata.get(name))
    for name in ("tgi_request_duration", "tgi_request_validation_duration", "tgi_batch_filter_duration"):
        assert metadata[name][0]["type"] == "histogram", name
    assert metadata["tgs_kv_cache_usage_ratio"][0]["type"] == "gauge"


def test_our_metrics_tell_the_same_story(prometheus, loaded, tiny_model):
    sel = f'container="{SERVICE_LABEL}"'

    def one(expr: str) -> float:
        values = _values(prometheus.query(expr))
        assert len(values) == 1, f"{expr} -> {values}"
        return values[0]

    # model_name on every series, as vLLM users filter by it
    assert one(f'count(tgi_request_count{{{sel},model_name="{tiny_model}"}})') == 1
    assert one(f'count({{{sel},__name__=~"tgi_.*|tgs_.*",model_name=""}})  or vector(0)') == 0
    successes = one(f"sum(tgi_request_success{{{sel}}})")
    assert one(f'sum(tgi_request_success{{{sel},finish_reason="length"}})') >= LONG_REQUESTS
    for name in ("tgs_request_prefill_duration_count", "tgs_request_decode_duration_count",
                 "tgi_request_duration_count", "tgi_request_generated_tokens_count"):
        assert one(f"sum({name}{{{sel}}})") == successes, name
    # every generated token counted once, live and per request
    assert one(f"sum(tgs_generation_tokens{{{sel}}})") == one(f"sum(tgi_request_generated_tokens_sum{{{sel}}})")
    prompt = one(f"sum(tgs_prompt_tokens{{{sel}}})")
    assert 0 < prompt <= one(f"sum(tgi_request_input_length_sum{{{sel}}})")
    assert one(f'sum(tgi_request_failure{{{sel},err="validation"}})') >= 1
    assert one(f'sum(tgi_batch_inference_count{{{sel}}}) - sum(tgi_batch_inference_success{{{sel}}})') == 0
    assert one(f"sum(tgi_batch_concat{{{sel}}})") > 0
    assert one(f"tgi_batch_max_total_tokens{{{sel}}}") > 0
    assert 0 < one(f"max_over_time(tgs_kv_cache_usage_ratio{{{sel}}}[10m])") <= 1
    assert one(f"tgs_kv_cache_usage_ratio{{{sel}}}") == 0
    assert one(f"tgs_shards_healthy{{{sel}}}") == 1


def test_info_reports_attention_prefix_caching_and_chunking(server):
    info = client_stub(server).Info(cpb.InfoRequest(), timeout=10)
    assert isinstance(info.prefix_caching, bool) and isinstance(info.chunked_prefill, bool)
    assert isinstance(info.attention_backend, str)


def test_reflection_v1_and_v1alpha_on_serve(server):
    reflection_v1_client.check_reflection(server.channel())


def test_health_list_on_serve(server):
    listed = health_pb2_grpc.HealthStub(server.channel()).List(health_pb2.HealthListRequest(), timeout=10)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert {k: v.status for k, v in listed.statuses.items()} == {"": serving, SERVICE_NAME: serving}


def _wait_status(stub, status: int, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status == status:
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"health never became {health_pb2.HealthCheckResponse.ServingStatus.Name(status)} "
                         f"within {timeout_s:.0f} s")


def test_a_rank_that_stops_answering_turns_health_not_serving(server):
    """Runs last: SIGSTOP rank 0 (as a hung collective looks from outside), then SIGCONT."""
    stub = health_pb2_grpc.HealthStub(server.channel())
    rank0 = server.shard_pids()[0]
    os.kill(rank0, signal.SIGSTOP)
    try:
        _wait_status(stub, health_pb2.HealthCheckResponse.NOT_SERVING, HEALTH_DETECTION_S)
        assert scrape(server).value("tgs_shards_healthy", None) == 0
        assert "shard rank 0" in server.log() and "no Health answer within" in server.log()
    finally:
        os.kill(rank0, signal.SIGCONT)
    _wait_status(stub, health_pb2.HealthCheckResponse.SERVING, HEALTH_DETECTION_S)
    assert scrape(server).value("tgs_shards_healthy", None) == 1
    assert "every shard answers Health again" in server.log()


def test_draining_is_not_serving_while_requests_finish(server):
    """Runs last (it stops the server): SIGTERM with requests in flight; health says NOT_SERVING
    for every service while they drain, and they still complete."""
    stub = client_stub(server)
    health = health_pb2_grpc.HealthStub(server.channel())
    prompt = long_greedy_prompt(stub, min_tokens=150, max_new_tokens=200)
    calls = [stub.GenerateStream(request(prompt, max_new_tokens=200), timeout=60) for _ in range(LONG_REQUESTS)]
    first = next(calls[0])  # generation is running, the rest are queued behind --max-batch-size 2
    assert first.token.text is not None
    # Every call reached the scheduler (a call still being validated when the drain starts is refused).
    poll_metrics(server, lambda s: s.value("tgi_queue_size", None) + s.value("tgi_batch_current_size", None)
                 == LONG_REQUESTS)
    server.proc.send_signal(signal.SIGTERM)
    listed = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        listed = health.List(health_pb2.HealthListRequest(), timeout=5)
        if all(v.status == health_pb2.HealthCheckResponse.NOT_SERVING for v in listed.statuses.values()):
            break
        time.sleep(0.02)
    assert listed is not None and set(listed.statuses) == {"", SERVICE_NAME}
    assert all(v.status == health_pb2.HealthCheckResponse.NOT_SERVING for v in listed.statuses.values()), listed
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        finished = list(pool.map(lambda call: list(call)[-1].HasField("generated_text"), calls))
    assert all(finished)
    assert server.wait_exit(30) == 0

"""/metrics: TGI's names, types and labels, bare counters beside `_total`, model_name on every
sample, text format 0.0.4 whatever the scraper asks for. (A real Prometheus scrapes it in
integration-tests/test_prometheus_dashboard.py.)"""

from __future__ import annotations

import gzip
import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from text_generation_server.router.metrics import CONTENT_TYPE, Metrics, render_text

DASHBOARD = json.loads((Path(__file__).parent / "data" / "tgi_grafana_queries.json").read_text())
# Labels we add to TGI's metrics (queries aggregate over them).
EXTRA_LABELS = {"model_name"}
EXTRA_BY_METRIC = {"tgi_request_success": {"finish_reason"}}

_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$")
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """(family -> type, samples) from the text format, strictly: every line is a comment or a sample."""
    types, samples = {}, []
    for line in text.splitlines():
        if m := _TYPE.match(line):
            assert m[1] not in types, f"family {m[1]} typed twice"
            types[m[1]] = m[2]
        elif line.startswith("# HELP "):
            continue
        else:
            m = _SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            labels = dict(_LABEL.findall(m[2] or ""))
            samples.append((m[1], labels, float(m[3])))
    return types, samples


def family_of(sample: str, types: dict[str, str]) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        base = sample.removesuffix(suffix)
        if base != sample and types.get(base) == "histogram":
            return base
    return sample


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(model_name="org/model-7b")


def test_counters_have_tgi_bare_names_and_total_names(metrics):
    metrics.request_count.labels(adapter="").inc(3)
    metrics.request_failure.labels(err="validation", adapter="").inc()
    metrics.batch_inference_count.labels(method="decode").inc(5)
    types, samples = parse(metrics.render().decode())
    values = {(n, tuple(sorted(lb.items()))): v for n, lb, v in samples}
    for name in ("tgi_request_count", "tgi_request_failure", "tgi_batch_inference_count", "tgs_request_cancelled"):
        assert types[name] == "counter" and types[f"{name}_total"] == "counter", name
        bare = {k[1]: v for k, v in values.items() if k[0] == name}
        total = {k[1]: v for k, v in values.items() if k[0] == f"{name}_total"}
        assert bare and bare == total, name
    assert values[("tgi_request_count", (("model_name", "org/model-7b"),))] == 3
    assert values[("tgi_request_failure", (("err", "validation"), ("model_name", "org/model-7b")))] == 1
    assert values[("tgi_batch_inference_count", (("method", "decode"), ("model_name", "org/model-7b")))] == 5
    assert not [n for n, _, _ in samples if n.endswith("_created")], "no _created series"


def test_every_sample_carries_model_name_and_the_page_parses(metrics):
    metrics.request_duration.observe(0.2)
    text = metrics.render().decode()
    types, samples = parse(text)
    assert samples and all(lb.get("model_name") == "org/model-7b" for _, lb, _ in samples)
    for name, _, _ in samples:
        assert family_of(name, types) in types, f"{name} has no # TYPE"
    # prometheus_client's own parser reads it too (it folds the bare counters into their family)
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {"tgi_request_count", "tgi_request_duration", "tgs_kv_cache_usage_ratio"} <= families


def test_label_values_are_escaped():
    odd = Metrics(model_name='a "quoted"\\model\nname')
    [line] = [ln for ln in odd.render().decode().splitlines() if ln.startswith("tgi_queue_size{")]
    assert line == 'tgi_queue_size{model_name="a \\"quoted\\"\\\\model\\nname"} 0.0'
    [family] = [f for f in text_string_to_metric_families(line) if f.name == "tgi_queue_size"]
    assert family.samples[0].labels["model_name"] == 'a "quoted"\\model\nname'


def test_tgi_metrics_have_tgi_types_and_labels(metrics):
    """Every TGI metric (tests/data: name -> type, labels from TGI's router) with its type and labels."""
    types, samples = parse(metrics.render().decode())
    labels_of: dict[str, set[str]] = {}
    for name, labels, _ in samples:
        labels_of.setdefault(family_of(name, types), set()).update(k for k in labels if k != "le")
    for name, (typ, labels) in DASHBOARD["tgi_metrics"].items():
        assert types.get(name) == typ, f"{name}: {types.get(name)} instead of {typ}"
        assert labels_of[name] == set(labels) | EXTRA_LABELS | EXTRA_BY_METRIC.get(name, set()), name


def test_every_dashboard_metric_is_a_tgi_metric_we_export(metrics):
    types, _ = parse(metrics.render().decode())
    used = {n for q in DASHBOARD["queries"] for n in q["metrics"]}
    assert used <= set(DASHBOARD["tgi_metrics"]), used - set(DASHBOARD["tgi_metrics"])
    assert used <= set(types)
    for q in DASHBOARD["queries"]:
        assert q["expect"] in DASHBOARD["expect_legend"], q
        assert q["expect"] == "positive" or q.get("why"), f"query {q['id']} is not 'positive' and says not why"


def test_known_label_values_start_at_zero(metrics):
    """rate()/increase() see the first event only if the series existed before it."""
    _, samples = parse(metrics.render().decode())
    present = {(n, tuple(sorted((k, v) for k, v in lb.items() if k != "model_name"))) for n, lb, _ in samples}
    for method in ("prefill", "decode"):
        for name in ("tgi_batch_inference_count", "tgi_batch_inference_success", "tgi_batch_inference_failure"):
            assert (name, (("method", method),)) in present
        assert ("tgi_batch_filter_duration_count", (("method", method),)) in present
    assert ("tgi_batch_concat_duration_count", (("method", "decode"),)) in present
    for reason in ("backpressure", "wait_exceeded", "chunking"):
        assert ("tgi_batch_concat", (("reason", reason),)) in present
    for reason in ("length", "eos_token", "stop_sequence"):
        assert ("tgi_request_success", (("finish_reason", reason),)) in present
    for err in ("validation", "overloaded", "dropped", "prefill", "decode"):
        assert ("tgi_request_failure", (("err", err),)) in present


def test_kv_cache_usage_ratio(metrics):
    metrics.set_kv_blocks(used=3, free=1)
    assert (metrics.kv_blocks_used._value.get(), metrics.kv_blocks_free._value.get()) == (3, 1)
    assert metrics.kv_cache_usage._value.get() == 0.75
    metrics.set_kv_blocks(used=0, free=0)
    assert metrics.kv_cache_usage._value.get() == 0.0


def test_prefix_cache_and_chunked_prefill_definitions(metrics):
    expected = {
        "prefix_cache_queries": ("tgs_prefix_cache_queries", "counter"),
        "prefix_cache_hits": ("tgs_prefix_cache_hits", "counter"),
        "prefix_cache_query_tokens": ("tgs_prefix_cache_query_tokens", "counter"),
        "prefix_cache_hit_tokens": ("tgs_prefix_cache_hit_tokens", "counter"),
        "prefix_cache_evictions": ("tgs_prefix_cache_evictions", "counter"),
        "prefix_cache_blocks": ("tgs_prefix_cache_blocks", "gauge"),
        "chunked_prefills": ("tgs_chunked_prefills", "counter"),
        "prefill_chunks": ("tgs_prefill_chunks", "counter"),
    }
    types, _ = parse(metrics.render().decode())
    for attribute, (name, typ) in expected.items():
        assert getattr(metrics, attribute)._name == name, attribute
        assert types[name] == typ
        if typ == "counter":
            assert types[f"{name}_total"] == "counter"


def test_unknown_metric_types_are_refused():
    from prometheus_client import CollectorRegistry, Enum

    registry = CollectorRegistry()
    Enum("tgs_state", "a state", states=["a", "b"], registry=registry)
    with pytest.raises(ValueError, match="tgs_state.*stateset"):
        render_text(registry)


def test_http_endpoint_serves_text_format_even_when_openmetrics_is_asked(metrics):
    metrics.request_count.labels(adapter="").inc()
    server = metrics.serve(0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        accept = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                  "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # what Prometheus 2.42 sends
        req = urllib.request.Request(url, headers={"Accept": accept, "Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Content-Type"] == CONTENT_TYPE
            assert resp.headers["Content-Encoding"] == "gzip"
            text = gzip.decompress(resp.read()).decode()
        assert 'tgi_request_count{model_name="org/model-7b"} 1.0' in text.splitlines()
        with urllib.request.urlopen(url, timeout=10) as resp:  # no gzip asked, none given
            assert resp.headers.get("Content-Encoding") is None and resp.read().decode() == metrics.render().decode()
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/favicon.ico", timeout=10)
        assert info.value.code == 404
    finally:
        server.shutdown()


def test_fast_observer_counts_as_the_histograms_own_observe():
    """The scheduler's fast_observer: the same buckets, count and sum as Histogram.observe for
    every kind of amount (on a bound, between, below the first, above the last, negative, +Inf,
    NaN), unlabelled or a labelled child; a histogram without that layout keeps its own observe."""
    from prometheus_client import CollectorRegistry, Histogram

    from text_generation_server.router.metrics import fast_observer

    amounts = [0.0001, 0.0003, 0.00025, 0.0, -1.0, 0.5, 60.0, 61.0, float("inf"), float("nan"), 1e-9, 2.5, 0.7]
    for labelled in (False, True):
        pages = []
        for fast in (False, True):
            registry = CollectorRegistry(auto_describe=False)
            family = Histogram("t_seconds", "t", ["method"] if labelled else [],
                               buckets=(0.0001, 0.00025, 0.5, 1, 2.5, 60), registry=registry)
            histogram = family.labels(method="decode") if labelled else family
            observe = fast_observer(histogram) if fast else histogram.observe
            assert (observe != histogram.observe) == fast  # the fast path is what runs
            for amount in amounts:
                observe(amount)
            pages.append(render_text(registry))
        assert pages[0] == pages[1]
        assert "nan" in pages[1].lower()  # the NaN reached the sum through the library's observe

    registry = CollectorRegistry(auto_describe=False)
    parent = Histogram("p_seconds", "p", ["method"], registry=registry)
    assert fast_observer(parent) == parent.observe  # a labelled parent: its own observe (which refuses)

"""Prometheus metrics of the router.

Names reuse TGI's `tgi_*` metrics where the meaning is the same, so existing TGI
dashboards keep working; `tgs_*` names are ours (KV blocks, cancellations).
Each `Metrics` owns its registry, so several routers (tests) never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.request_count = Counter("tgi_request_count", "Requests received", registry=r)
        self.request_success = Counter("tgi_request_success", "Requests that completed", registry=r)
        self.request_failure = Counter("tgi_request_failure", "Requests that failed, by reason", ["err"], registry=r)
        self.request_cancelled = Counter("tgs_request_cancelled", "Requests cancelled by the client", registry=r)
        self.queue_size = Gauge("tgi_queue_size", "Requests waiting in the queue", registry=r)
        self.batch_current_size = Gauge("tgi_batch_current_size", "Requests in the running batch", registry=r)
        self.batch_current_max_tokens = Gauge(
            "tgi_batch_current_max_tokens", "Maximum tokens the running batch may reach", registry=r
        )
        self.batch_next_size = Histogram("tgi_batch_next_size", "Size of newly prefilled batches",
                                         buckets=_BATCH_BUCKETS, registry=r)
        self.kv_blocks_used = Gauge("tgs_kv_blocks_used", "KV cache blocks held by requests", registry=r)
        self.kv_blocks_free = Gauge("tgs_kv_blocks_free", "KV cache blocks free", registry=r)
        self.batch_inference_duration = Histogram(
            "tgi_batch_inference_duration", "Prefill/decode step duration (router view)", ["method"],
            buckets=_DURATION_BUCKETS, registry=r)
        self.batch_forward_duration = Histogram(
            "tgi_batch_forward_duration", "Model forward duration", ["method"], buckets=_DURATION_BUCKETS, registry=r)
        self.batch_decode_duration = Histogram(
            "tgi_batch_decode_duration", "Token choice and detokenisation duration", ["method"],
            buckets=_DURATION_BUCKETS, registry=r)
        self.batch_inference_success = Counter("tgi_batch_inference_success", "Successful steps", ["method"],
                                               registry=r)
        self.batch_inference_failure = Counter("tgi_batch_inference_failure", "Failed steps", ["method"], registry=r)
        self.request_queue_duration = Histogram(
            "tgi_request_queue_duration", "Time in queue", buckets=_DURATION_BUCKETS, registry=r)
        self.request_inference_duration = Histogram(
            "tgi_request_inference_duration", "Time from prefill to last token", buckets=_DURATION_BUCKETS,
            registry=r)
        self.request_duration = Histogram(
            "tgi_request_duration", "End-to-end request duration", buckets=_DURATION_BUCKETS, registry=r)
        self.time_to_first_token = Histogram(
            "tgs_request_time_to_first_token", "Time from arrival to first token", buckets=_DURATION_BUCKETS,
            registry=r)
        self.inter_token_latency = Histogram(
            "tgs_request_inter_token_latency", "Time between consecutive tokens of a request",
            buckets=_DURATION_BUCKETS, registry=r)
        self.mean_time_per_token = Histogram(
            "tgi_request_mean_time_per_token_duration", "Mean time per generated token",
            buckets=_DURATION_BUCKETS, registry=r)
        self.input_length = Histogram("tgi_request_input_length", "Input tokens per request",
                                      buckets=_TOKEN_BUCKETS, registry=r)
        self.generated_tokens = Histogram("tgi_request_generated_tokens", "Generated tokens per request",
                                          buckets=_TOKEN_BUCKETS, registry=r)
        self.max_new_tokens = Histogram("tgi_request_max_new_tokens", "max_new_tokens per request",
                                        buckets=_TOKEN_BUCKETS, registry=r)

    def serve(self, port: int, addr: str = "127.0.0.1") -> object:
        """Starts the /metrics HTTP endpoint; returns the server so it can be shut down."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server

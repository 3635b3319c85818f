"""Prometheus metrics of the gateway (client-facing latencies), served at GET /metrics.

Time to first token, inter-token latency and end-to-end latency are measured per generation as the client sees
them (from the request reaching the gateway), plus request counts by path template (`/v1/chat/completions`;
`unmatched` for any unknown path, so junk URLs add no series) and HTTP status, the generations waiting for their
first token and running (one per choice), and constrained decoding's token counts (constrained, forced, forced runs:
forced tokens / generated tokens is the share of the answer the grammar wrote without the model) and budget-aware
endings.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from common.telemetry import LATENCY_BUCKETS


class GatewayMetrics:
    """The gateway's metrics in their own registry."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "gemma_serve:gateway_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Request arrival to the first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between consecutive tokens seen by the client.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Request arrival to the last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter(p + "requests", "HTTP requests by route template (path label; 'unmatched' for "
                                "unknown paths) and status.", ["path", "status"], registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Generations (one per choice) sent to the model worker and "
                             "waiting for their first token.", registry=r)
        self.running = Gauge(p + "num_requests_running", "Generations (one per choice) streaming tokens.", registry=r)
        self.tokens = Counter(p + "generation_tokens", "Tokens generated for clients.", registry=r)
        self.constrained_tokens = Counter(p + "constrained_tokens", "Tokens generated under a grammar (sampled "
                                          "with a mask or forced).", registry=r)
        self.forced_tokens = Counter(p + "forced_tokens", "Tokens the grammar determined (the only allowed "
                                     "continuation), sent as one-token masks or in forced runs.", registry=r)
        self.forced_runs = Counter(p + "forced_runs", "Runs of forced tokens sent to the worker (computed in one "
                                   "compute step per chunk).", registry=r)
        self.forced_run_tokens = Counter(p + "forced_run_tokens", "Tokens in forced runs.", registry=r)
        self.budget_endings = Counter(p + "budget_endings", "Constrained answers ended after a complete unit "
                                      "because max_tokens could not fit another (gateway/structured/budget.py), by kind "
                                      "of unit.", ["kind"], registry=r)
        self.routed = Counter(p + "routed_requests", "Requests routed to a model worker, by worker and reason "
                              "(session: its session key's worker; session_spill: the next one, the first being "
                              "over its load bound; prefix: the worker holding its prompt's prefix; hash / "
                              "hash_spill: by a hash of the conversation; gateway/backends/worker_choice.py).",
                              ["worker", "reason"], registry=r)
        self.failovers = Counter(p + "worker_failovers", "Calls that found their model worker unreachable (the "
                                 "worker leaves the routing ring until its health check passes).", ["worker"],
                                 registry=r)

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of the /metrics response."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

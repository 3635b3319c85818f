"""Prometheus metrics of the model worker, with the field's names (vLLM's, under the `gemma_serve:` prefix).

Served on their own HTTP port (`--worker-metrics-port`, or the unix socket `--metrics-uds`; path /metrics) since the worker's API is gRPC. Latencies are
measured at the worker: from the Prefill call's arrival (time to first token, end to end), between tokens as
they leave the engine (inter-token latency), from arrival to admission into a slot (queue time), from admission
to the first token (prefill time: the prompt's chunks, or the wait for a leader computing a shared prompt) and
from the first token to the last (decode time). Prompt tokens are counted three ways: received, reused from the
prefix cache (or a leader's slot) and computed, so a burst that computes the same prompt again shows at once. The
engine loop refreshes the gauges (running, waiting, KV usage) and the prefix-cache and token counters after every
iteration.
"""

from __future__ import annotations

import socketserver
import threading

import jax
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import MetricsHandler

from common import uds
from common.telemetry import LATENCY_BUCKETS


class WorkerMetrics:
    """The worker's metrics in their own registry (thread-safe: updated from the engine thread and the gRPC loop)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        p = "gemma_serve:"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Prefill arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Prefill arrival to the last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(p + "request_queue_time_seconds", "Arrival to admission into a slot.",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram(p + "request_prefill_time_seconds", "Admission into a slot to the first token.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.decode = Histogram(p + "request_decode_time_seconds", "First token to the last.",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests holding a slot.", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting for a slot.", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Share of the KV positions held by running requests.",
                              registry=r)
        self.cached_slots = Gauge(p + "prefix_cache_slots", "Slots holding finished or snapshot KV.", registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Admissions looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Admissions that reused a cached prefix.", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens received.", registry=r)
        self.cached_tokens = Counter(p + "prompt_tokens_cached", "Prompt tokens whose KV was reused.", registry=r)
        self.prompt_computed = Counter(p + "prompt_tokens_computed", "Prompt tokens run through the model.",
                                       registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", registry=r)
        self.computed_tokens = Counter(p + "computed_tokens", "Tokens run through the model.", registry=r)
        self.steps = Counter(p + "engine_steps", "Engine steps: compute chunks, decode steps, slot copies; mixed: "
                             "iterations with both a chunk and a decode step (also counted in those); verify: decode "
                             "steps that verified drafts (speculation on; also counted in decode); ahead: decode "
                             "steps dispatched before the previous step's tokens reached the host (async "
                             "scheduling; also counted in decode).", ["kind"],
                             registry=r)
        # Speculative decoding, with vLLM's names (`vllm:spec_decode_num_draft_tokens`, ...).
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.acceptance = Gauge(p + "spec_decode_acceptance_rate", "Accepted / verified draft tokens since start.",
                                registry=r)
        self.accepted_length = Histogram(p + "spec_decode_accepted_length", "Draft tokens accepted per verified "
                                         "draft (a row of a verify step).", buckets=tuple(range(17)), registry=r)
        self.rejected = Counter(p + "requests_rejected", "Requests refused because the queue was full.", registry=r)
        self.slo_refusals = Counter(p + "slo_refusals", "Requests refused early because a latency target could not "
                                    "be met (model_worker/serving/slo.py), by reason.", ["reason"], registry=r)
        self.slo_attainment = Counter(p + "slo_requests", "Requests with a latency target, by target (ttft, tpot) "
                                      "and whether it was met.", ["target", "met"], registry=r)
        self.step_prediction_error = Histogram(p + "step_time_prediction_relative_error", "|predicted - measured| "
                                               "/ measured step time of the step-time model (model_worker/"
                                               "step_model.py).", buckets=(0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5,
                                                                           1.0, 2.0), registry=r)
        self.compilations = Counter(p + "compilations", "XLA compilations (after warm-up this must stay flat).",
                                    registry=r)
        self.programs = Gauge(p + "compiled_programs", "Programs of the grid compiled so far.", registry=r)
        self.programs_compiling = Gauge(p + "programs_compiling", "Programs of the grid still compiling in the "
                                        "background (0: full speed; the worker serves meanwhile).", registry=r)
        self.leased_slots = Gauge(p + "leased_slots", "Slots whose KV is leased to a session (kept after its "
                                  "request, exempt from LRU eviction).", registry=r)
        self.lease_preemptions = Counter(p + "lease_preemptions", "Session leases ended early because a request "
                                         "waited --lease-preempt-after seconds for a slot.", registry=r)
        self._seen = {"queries": 0, "hits": 0, "steps": {}, "computed": 0, "prompt": 0, "reused": 0,
                      "preempted": 0}
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._on_compile)

    def _on_compile(self, event: str, duration: float, **kwargs) -> None:
        if "backend_compile" in event:
            self.compilations.inc()

    def observe_iteration(self, snap) -> None:
        """Refresh gauges and counters from a `loop.LoopSnapshot` (called on the engine thread after each
        iteration)."""
        self.running.set(snap.running)
        self.waiting.set(snap.waiting)
        self.kv_usage.set(snap.kv_usage)
        self.cached_slots.set(snap.cached_slots)
        with self._lock:
            seen = self._seen
            self.prefix_queries.inc(snap.prefix_queries - seen["queries"])
            self.prefix_hits.inc(snap.prefix_hits - seen["hits"])
            seen["queries"], seen["hits"] = snap.prefix_queries, snap.prefix_hits
            for kind in ("compute", "decode", "mixed", "copy", "verify", "ahead"):
                self.steps.labels(kind).inc(snap.steps[kind] - seen["steps"].get(kind, 0))
                seen["steps"][kind] = snap.steps[kind]
            self.draft_tokens.inc(snap.steps["drafted_tokens"] - seen["steps"].get("drafted_tokens", 0))
            self.accepted_tokens.inc(snap.steps["accepted_tokens"] - seen["steps"].get("accepted_tokens", 0))
            seen["steps"]["drafted_tokens"] = snap.steps["drafted_tokens"]
            seen["steps"]["accepted_tokens"] = snap.steps["accepted_tokens"]
            if snap.steps["drafted_tokens"]:
                self.acceptance.set(snap.steps["accepted_tokens"] / snap.steps["drafted_tokens"])
            self.computed_tokens.inc(snap.steps["computed_tokens"] - seen["computed"])
            seen["computed"] = snap.steps["computed_tokens"]
            self.prompt_computed.inc(snap.steps["prompt_tokens"] - seen["prompt"])
            seen["prompt"] = snap.steps["prompt_tokens"]
            self.cached_tokens.inc(snap.reused_tokens - seen["reused"])
            seen["reused"] = snap.reused_tokens
            self.lease_preemptions.inc(snap.lease_preemptions - seen["preempted"])
            seen["preempted"] = snap.lease_preemptions
        self.leased_slots.set(snap.leased_slots)

    def serve(self, port: int, host: str = "127.0.0.1", socket_path: str | None = None) -> None:
        """Expose /metrics over HTTP on `port` of `host`, or on the unix socket `socket_path` when given (a daemon
        thread either way).

        Raises:
          common.uds.SocketPathError: the socket path cannot be used (the message says why).
          OSError: the port cannot be bound.
        """
        if socket_path is None:
            start_http_server(port, addr=host, registry=self.registry)
            return
        server = _UnixHTTPServer(uds.bind(socket_path), MetricsHandler.factory(self.registry))
        threading.Thread(target=server.serve_forever, name="metrics-uds", daemon=True).start()


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """prometheus_client's handler on an already bound unix socket (`uds.bind`: checked path, owner-only mode)."""

    daemon_threads = True

    def __init__(self, sock, handler):
        super().__init__(sock.getsockname(), handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.server_activate()

    def get_request(self):
        request, _ = self.socket.accept()
        return request, ("unix", 0)  # the handler's address_string() reads [0]; a unix peer has no address

"""The owner of the gateway's backends (`Backends`) and a request's view of them (`RequestBackends`).

No request logic here: thin wrappers that turn gRPC errors into ApiError. Every unary call has a deadline
(`Timeouts`: 504 / DEADLINE_EXCEEDED when it passes), channels send keepalive pings (common/network.py), and
`Backends.watch` follows the backends' health for the gateway's life: the model facts (model_facts.py) are fetched
when both serve and fetched again when one comes back after being away (a restarted worker may serve another
configuration).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc

from common.network import InternalTls
from gateway.backends.admission import Admission
from gateway.backends.grammar_tokenizer import GrammarTokenizer
from gateway.backends.history import AnswerHistory
from gateway.backends.metrics import GatewayMetrics
from gateway.backends.model_facts import ModelFacts, ServedModel
from gateway.backends.tokenizer_client import TokenizerClient
from gateway.backends.worker_choice import NoWorkerError
from gateway.backends.workers import WorkerPool
from gateway.core.errors import ApiError, from_rpc_error
from protos import model_worker_pb2_grpc, tokenizer_pb2_grpc

log = logging.getLogger("gemma_serve.gateway")


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Deadlines of backend calls, in seconds.

    Attributes:
      tokenizer: each tokenizer-service call (tokenizing a full context takes well under a second).
      worker: each unary model-worker call (a Prefill waits for a free slot, so this bounds time in the queue
        too) and the longest silence tolerated on a Decode stream.
    """

    tokenizer: float = 30.0
    worker: float = 300.0


class _DefaultDeadline(grpc.aio.UnaryUnaryClientInterceptor):
    """Gives every unary call on a channel a deadline unless the caller set one."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        if client_call_details.timeout is None:
            client_call_details = client_call_details._replace(timeout=self.seconds)
        return await continuation(client_call_details, request)


class RequestBackends:
    """The backends as one request sees them: `Backends` with the model facts pinned at the request's first
    `ready_facts()`, so its planning, generation and rendering read one `ModelFacts` snapshot even when the facts
    are refreshed meanwhile (a backend restarted). Everything else is the shared `Backends`' (channels, pool,
    history, admission, metrics). Made by each front door per request (`Backends.for_request`)."""

    def __init__(self, backends: Backends):
        self._backends = backends
        self._facts: ModelFacts | None = None

    def ready_facts(self) -> ModelFacts:
        """The request's snapshot of the model facts (taken on the first call; `Backends.ready_facts`' errors)."""
        if self._facts is None:
            self._facts = self._backends.ready_facts()
        return self._facts

    def for_request(self) -> RequestBackends:
        """Itself: a request's view is already one."""
        return self

    def __getattr__(self, name: str):
        return getattr(self._backends, name)


class Backends:
    """The gateway's backends for its whole life, as parts with one owner each: the tokenizer service's connection
    (`tokenizer_service`: tokenizer_client.py), the model workers (`pool`: workers.py), the model facts fetched from
    both (`served`: model_facts.py; `facts`, None until they are ready; kept fresh by `watch`), the grammar
    tokenizer built from them (`grammar`: grammar_tokenizer.py), the answer history, admission and the metrics. A
    request sees them through a view (`for_request`; what each function uses: views.py)."""

    def __init__(self, tokenizer_addr: str, worker_addrs: list[str] | str, served_model_name: str | None = None,
                 tls: InternalTls | None = None, timeouts: Timeouts | None = None, refresh_s: float = 5.0):
        """Args: tokenizer_addr: host:port of the tokenizer service; worker_addrs: host:port of each model worker
        (a name may stand for several: gateway/backends/workers.py); served_model_name: overrides the model id in the
        API; tls: mutual TLS for every link (None: plain text, for loopback or a trusted network); timeouts: call
        deadlines (default: Timeouts()); refresh_s: seconds between DNS resolutions of the worker addresses.

        Raises:
          ValueError: no worker address, or a malformed one.
        """
        self.tls = tls
        self.timeouts = timeouts or Timeouts()
        self.tokenizer_service = TokenizerClient(tokenizer_addr, tls, [_DefaultDeadline(self.timeouts.tokenizer)])
        targets = [worker_addrs] if isinstance(worker_addrs, str) else list(worker_addrs)
        self.pool = WorkerPool(targets, tls, [_DefaultDeadline(self.timeouts.worker)], refresh_s)
        self.answers = AnswerHistory()
        self.admission = Admission()
        self.metrics = GatewayMetrics()
        self.grammar = GrammarTokenizer()
        self.served = ServedModel(self.tokenizer_service, self.pool, self.grammar, served_model_name)
        self.worker_statuses: dict[str, str] = {}  # each worker's health at the last poll, by address

    async def grammar_tokenizer(self):
        """The llguidance tokenizer of the served vocabulary (grammar_tokenizer.py), built once when the backends
        become ready.

        Raises:
          ApiError: 503 while the backends are not ready.
        """
        return await self.served.grammar_tokenizer()

    @property
    def facts(self) -> ModelFacts | None:
        """The model facts, None until they are ready (`served.facts`)."""
        return self.served.facts

    @facts.setter
    def facts(self, facts: ModelFacts | None) -> None:
        self.served.facts = facts

    @property
    def tokenizer(self) -> tokenizer_pb2_grpc.TokenizerStub:
        """Tokenizer service stub."""
        return self.tokenizer_service.stub

    def worker(self, addr: str) -> model_worker_pb2_grpc.ModelWorkerStub:
        """The stub of the worker a request was routed to (`route`).

        Raises:
          ApiError: 503 when that worker has left the pool since.
        """
        try:
            return self.pool.stub(addr)
        except KeyError:
            raise ApiError(503, f"model worker {addr} is gone; retry", code="backend_unavailable") from None

    def route(self, session_key: str | None, prompt_ids: list[int], salt: str, tiebreak: str) -> str:
        """The worker address for one request (every RPC of all its choices goes there); see
        `WorkerPool.route`.

        Raises:
          ApiError: 503 when no worker serves.
        """
        try:
            choice = self.pool.route(session_key, prompt_ids, salt, tiebreak)
        except NoWorkerError:
            raise ApiError(503, "no model worker is available; retry shortly", code="backend_unavailable") from None
        self.metrics.routed.labels(choice.addr, choice.reason).inc()
        return choice.addr

    async def health(self, timeout: float = 2.0) -> dict[str, str]:
        """Each backend's status name ("SERVING", "NOT_SERVING" or "UNREACHABLE"): the tokenizer service, and
        the model workers as one ("SERVING" when at least one serves the gateway's model; each worker's own
        status is in `worker_statuses`)."""
        tok, workers = await asyncio.gather(self.tokenizer_service.health(timeout), self.pool.poll(timeout))
        self.worker_statuses = workers
        usable = [a for a, s in workers.items() if s == "SERVING" and a not in self.pool.refused]
        worst = "NOT_SERVING" if "NOT_SERVING" in workers.values() else "UNREACHABLE"
        return {"tokenizer service": tok, "model worker": "SERVING" if usable else worst}

    async def wait_ready(self, poll: float = 0.5) -> None:
        """Poll health until both backends serve, then fetch the model facts."""
        while self.facts is None:
            statuses = await self.health()
            if all(s == "SERVING" for s in statuses.values()):
                await self.served.refresh()
            elif statuses["tokenizer service"] == "SERVING" and not self.served.prefetched:
                await self.served.prefetch()
            if self.facts is None:  # an unsupported model is not retried at the polling rate (a whole vocabulary)
                await asyncio.sleep(poll if self.served.error is None else max(poll, 10.0))

    async def watch(self, poll: float = 0.5) -> None:
        """Follow the backends' health for the gateway's life (a background task): fetch the facts when both
        serve, and again after they were away (restarted: their facts may differ); check each worker that
        (re)joins against the facts (`ServedModel.check_worker`). Requests meanwhile fail on their own calls (503),
        so this only decides when the facts are trusted again. Also polls load for routing (`WorkerPool.poll`)."""
        await self.wait_ready(poll)
        away, joined = False, set(self._serving_workers())
        while True:
            await asyncio.sleep(poll)
            statuses = await self.health()
            if any(s != "SERVING" for s in statuses.values()) and not self._serving_workers():
                if not away:
                    log.warning("backend away: %s", ", ".join(f"{k} {v}" for k, v in statuses.items()))
                away, joined = True, set()
            elif statuses["tokenizer service"] != "SERVING":
                if not away:
                    log.warning("backend away: tokenizer service %s", statuses["tokenizer service"])
                away = True
            elif away and await self.served.refresh():
                log.info("backends serving again")
                away, joined = False, set(self._serving_workers())
            elif not away:
                for addr in set(self._serving_workers()) - joined:
                    await self.served.check_worker(addr)
                joined = set(self._serving_workers())

    def _serving_workers(self) -> list[str]:
        return [w.addr for w in self.pool.serving()]

    def for_request(self) -> RequestBackends:
        """A request's view of the backends: the model facts pinned at its first `ready_facts()`
        (`RequestBackends`)."""
        return RequestBackends(self)

    def ready_facts(self) -> ModelFacts:
        """The model facts.

        Raises:
          ApiError: 503 while the backends are not ready, or serve a model this gateway cannot (the message says
            why: e.g. an unknown model family, naming the supported ones).
        """
        return self.served.ready()

    async def call(self, backend: str, coro):
        """Await a unary RPC, translating gRPC errors.

        Raises:
          ApiError: the translated error.
        """
        try:
            return await coro
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, backend) from None

    async def close(self) -> None:
        """Close every channel."""
        await self.tokenizer_service.close()
        await self.pool.close()

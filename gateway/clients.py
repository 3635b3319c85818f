"""Async gRPC clients of the tokenizer service and the model worker, plus the facts fetched from them.

No request logic here: thin wrappers that turn gRPC errors into ApiError. Every unary call has a deadline
(`Timeouts`: 504 / DEADLINE_EXCEEDED when it passes), channels send keepalive pings (gemma_serve/network.py), and
`Backends.watch` follows the backends' health for the gateway's life: the model facts are fetched when both serve
and fetched again when one comes back after being away (a restarted worker may serve another configuration).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import families
from gateway.admission import Admission
from gateway.errors import ApiError, from_rpc_error
from gateway.history import AnswerHistory
from gateway.metrics import GatewayMetrics
from gateway.tool_format import FamilyFormat, SpecialTokens, UnknownTokenError, family_format
from gemma_serve.network import InternalTls, aio_channel
from protos import model_worker_pb2, model_worker_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc

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


@dataclasses.dataclass
class ModelFacts:
    """What the gateway needs to know about the served model (fetched when both backends are ready).

    `architecture` is the model family's registry name as the worker reports it (there is no default family);
    its output formats come from the family's gateway part (`output_format()`), with control tokens looked up by
    spelling in this vocabulary (`token_id`, `special_tokens`).
    """

    name: str
    max_model_len: int
    vocab_size: int
    token_bytes: list[bytes]
    special_ids: set[int]
    bos_id: int
    stop_ids: list[int]
    architecture: str
    tokenizer_json: str = ""
    eos_id: int = 1
    max_waiting: int = 64
    max_token_bytes: int = 64
    special_tokens: SpecialTokens = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # The longest token's bytes bound how much text max_model_len tokens can spell (planner's size check).
        if self.token_bytes:
            self.max_token_bytes = max(len(b) for b in self.token_bytes)
        self.special_tokens = SpecialTokens(self.token_bytes, self.special_ids)

    def token_id(self, spelling: str) -> int:
        """The id of the control token spelled `spelling` (`"<|tool_call>"`) in the served vocabulary.

        Raises:
          UnknownTokenError: the vocabulary has no control token with that spelling.
        """
        return self.special_tokens[spelling]

    def output_format(self) -> FamilyFormat:
        """The served family's output formats (tool calls, thought channel), from its gateway part.

        Raises:
          families.UnknownFamilyError: `architecture` names no registered family.
        """
        return family_format(self.architecture)


class Backends:
    """Channels and stubs for both backends; `facts` is None until they are ready."""

    def __init__(self, tokenizer_addr: str, worker_addr: str, served_model_name: str | None = None,
                 tls: InternalTls | None = None, timeouts: Timeouts | None = None):
        """Args: *_addr: host:port of each backend; served_model_name: overrides the model id in the API;
        tls: mutual TLS for both links (None: plain text, for loopback or a trusted network); timeouts: call
        deadlines (default: Timeouts())."""
        self.tokenizer_addr, self.worker_addr = tokenizer_addr, worker_addr
        self.tls = tls
        self.timeouts = timeouts or Timeouts()
        self.served_model_name = served_model_name
        self.facts: ModelFacts | None = None
        self.facts_error: str | None = None  # why the last facts fetch refused the served model, if it did
        self.answers = AnswerHistory()
        self.admission = Admission()
        self.metrics = GatewayMetrics()
        self._lltokenizer = None
        self._lltokenizer_lock = asyncio.Lock()
        self._channels: tuple[grpc.aio.Channel, grpc.aio.Channel] | None = None

    async def grammar_tokenizer(self):
        """The llguidance tokenizer of the served vocabulary, built once when the backends become ready (a costly
        build; figures: docs/performance.md). Its EOS is the tokenizer's eos only: other stop ids (end of turn,
        `<|tool_response>`) are handled by Constraint, and tool grammars reference them as tokens.

        Raises:
          ApiError: 503 while the backends are not ready.
        """
        facts = self.ready_facts()
        if self._lltokenizer is None:
            await self._build_grammar_tokenizer(facts)
        return self._lltokenizer

    async def _build_grammar_tokenizer(self, facts: ModelFacts) -> None:
        from gateway.constraints import build_tokenizer

        async with self._lltokenizer_lock:
            if self._lltokenizer is None:
                self._lltokenizer = await asyncio.to_thread(
                    build_tokenizer, facts.tokenizer_json, facts.vocab_size, [facts.eos_id])

    def _connect(self) -> tuple[grpc.aio.Channel, grpc.aio.Channel]:
        """Create the channels on first use, inside the running event loop (grpc.aio binds them to it)."""
        if self._channels is None:
            self._channels = (
                aio_channel(self.tokenizer_addr, self.tls, interceptors=[_DefaultDeadline(self.timeouts.tokenizer)]),
                aio_channel(self.worker_addr, self.tls, interceptors=[_DefaultDeadline(self.timeouts.worker)]),
            )
            self._tokenizer = tokenizer_pb2_grpc.TokenizerStub(self._channels[0])
            self._worker = model_worker_pb2_grpc.ModelWorkerStub(self._channels[1])
            self._health = {
                "tokenizer service": health_pb2_grpc.HealthStub(self._channels[0]),
                "model worker": health_pb2_grpc.HealthStub(self._channels[1]),
            }
        return self._channels

    @property
    def tokenizer(self) -> tokenizer_pb2_grpc.TokenizerStub:
        """Tokenizer service stub."""
        self._connect()
        return self._tokenizer

    @property
    def worker(self) -> model_worker_pb2_grpc.ModelWorkerStub:
        """Model worker stub."""
        self._connect()
        return self._worker

    async def health(self, timeout: float = 2.0) -> dict[str, str]:
        """Each backend's status name ("SERVING", "NOT_SERVING" or "UNREACHABLE")."""

        async def one(stub):
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
                return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError:
                return "UNREACHABLE"

        self._connect()
        names = list(self._health)
        statuses = await asyncio.gather(*(one(self._health[n]) for n in names))
        return dict(zip(names, statuses))

    async def wait_ready(self, poll: float = 0.5) -> None:
        """Poll health until both backends serve, then fetch the model facts."""
        while self.facts is None:
            if all(s == "SERVING" for s in (await self.health()).values()):
                await self._refresh_facts()
            if self.facts is None:  # an unsupported model is not retried at the polling rate (a whole vocabulary)
                await asyncio.sleep(poll if self.facts_error is None else max(poll, 10.0))

    async def watch(self, poll: float = 0.5) -> None:
        """Follow the backends' health for the gateway's life (a background task): fetch the facts when both
        serve, and again after one was away (restarted: its facts may differ). Requests meanwhile fail on their
        own calls (503), so this only decides when the facts are trusted again."""
        await self.wait_ready(poll)
        away = False
        while True:
            await asyncio.sleep(poll)
            statuses = await self.health()
            if any(s != "SERVING" for s in statuses.values()):
                if not away:
                    log.warning("backend away: %s", ", ".join(f"{k} {v}" for k, v in statuses.items()))
                away = True
            elif away and await self._refresh_facts():
                log.info("backends serving again")
                away = False

    async def _refresh_facts(self) -> bool:
        """Fetch the model facts; rebuild the grammar tokenizer when the vocabulary changed. Returns success."""
        try:
            facts = await self._fetch_facts()
            if self.facts is None or facts.tokenizer_json != self.facts.tokenizer_json:
                # Built before the facts are published: llguidance holds the GIL for the whole build, which would
                # stall the event loop inside the first constrained request (figures: docs/performance.md).
                self._lltokenizer = None
                await self._build_grammar_tokenizer(facts)
            self.facts, self.facts_error = facts, None
            log.info("backends ready: %s, max_model_len %d", facts.name, facts.max_model_len)
            return True
        except (grpc.aio.AioRpcError, ApiError) as err:
            log.warning("fetching model facts failed: %s", err)
            return False
        except (families.UnknownFamilyError, UnknownTokenError) as err:
            # Not transient: the backends serve a model this gateway cannot (requests get 503 with the reason).
            message = f"the served model is not supported by this gateway: {err}"
            if message != self.facts_error:
                log.error("%s", message)
            self.facts, self.facts_error = None, message
            return False

    async def _fetch_facts(self) -> ModelFacts:
        """The model facts from both backends' Info and the vocabulary, checked against the family registry.

        Raises:
          grpc.aio.AioRpcError: a backend call failed.
          ApiError: the vocabulary is larger than the model's.
          families.UnknownFamilyError: the worker reports a family no registered package serves (the message
            names it and the supported ones).
          UnknownTokenError: the vocabulary lacks a control token the family's formats need.
        """
        info = await self.worker.Info(model_worker_pb2.WorkerInfoRequest(), timeout=10)
        tinfo = await self.tokenizer.Info(tokenizer_pb2.TokenizerInfoRequest(), timeout=10)
        vocab = await self.tokenizer.GetVocab(tokenizer_pb2.GetVocabRequest(), timeout=60)
        if len(vocab.token_bytes) > info.vocab_size:
            raise ApiError(500, f"tokenizer vocabulary ({len(vocab.token_bytes)}) exceeds the model's ({info.vocab_size})")
        facts = ModelFacts(
            name=self.served_model_name or info.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            token_bytes=list(vocab.token_bytes) + [b""] * (info.vocab_size - len(vocab.token_bytes)),
            special_ids=set(vocab.special_token_ids),
            bos_id=tinfo.bos_token_id,
            stop_ids=list(info.default_stop_token_ids),
            tokenizer_json=vocab.tokenizer_json,
            architecture=info.architecture,
            eos_id=tinfo.eos_token_id,
            max_waiting=info.max_waiting,
        )
        try:
            facts.output_format().resolve(facts.special_tokens)
        except UnknownTokenError as err:
            raise UnknownTokenError(f"model family {facts.architecture!r}: {err}") from None
        return facts

    def ready_facts(self) -> ModelFacts:
        """The model facts.

        Raises:
          ApiError: 503 while the backends are not ready, or serve a model this gateway cannot (the message says
            why: e.g. an unknown model family, naming the supported ones).
        """
        if self.facts is None:
            if self.facts_error is not None:
                raise ApiError(503, self.facts_error, code="model_unsupported")
            raise ApiError(503, "the model is still loading; retry shortly", code="model_loading")
        return self.facts

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
        """Close both channels."""
        if self._channels is not None:
            for channel in self._channels:
                await channel.close()

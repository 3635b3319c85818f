"""One generation, as an async stream of deltas: Prefill -> Decode stream -> detokenize -> stop strings.

Shared by the REST endpoints and the gRPC Generate API, so streamed and non-streamed answers come from the same
code. Token counts come from the worker's tokens: `completion_tokens` counts every generated token up to and
including the one that ended the sequence (a stop token, or the token that completed a stop string); tokens the
worker produced after a stop string matched are discarded, whatever the timing. Leaving the stream early (client
disconnect, cancellation) aborts the request on the worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import grpc

from common.ngram import NGRAM_MAX, NgramIndex
from gateway.backends.views import ModelFactsView, WorkerView
from gateway.backends.workers import Reservation, Session
from gateway.core.errors import ApiError, from_rpc_error
from gateway.generation.detokenizer import IncrementalDetokenizer, StopMatcher
from gateway.structured.constraints import ConstraintError
from protos import common_pb2, model_worker_pb2

log = logging.getLogger("gemma_serve.gateway")
FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


class Matcher(Protocol):
    """A generation's grammar state as `ConstraintDriver` uses it (gateway/structured/constraints.py `Constraint`, and
    its wrappers reasoning.ThoughtFirst and budget.BudgetedUnits)."""

    vocab_size: int

    def mask(self) -> bytes:
        """The packed allowed-token mask of the next token."""

    def advance(self, token_id: int) -> None:
        """Take one token (raises ConstraintError when the grammar does not allow it)."""

    def fork(self) -> Matcher:
        """An independent copy (to try draft tokens)."""


@dataclasses.dataclass(frozen=True)
class GenParams:
    """What to generate, complete when built (gateway/planning/planner.py builds one per choice, in one piece).

    Attributes:
      sampling: worker sampling settings.
      max_tokens: the answer's limit in tokens, decided once by the planner (`answer_limit.answer_budget`).
      stop: stop strings (the match is not returned).
      stop_token_ids: extra stop ids.
      ignore_eos: do not stop on the model's default stop ids.
      skip_special_tokens: leave control tokens out of the text.
      allowed_token_ids: restrict every step to these ids (vLLM's `allowed_token_ids`), or None.
      share_prompt_with: request id of a sibling choice with the same prompt whose KV to reuse (n > 1).
      constraint: a grammar matcher for this generation (gateway/structured/constraints.py `Constraint`: mask(),
        advance(), forced(), done()), or None.
      initial_mask: the constraint's mask of token 0, computed when the request was planned (None: compute it
        here).
      constraint_param: the request field the grammar comes from ("response_format" or "tools"), named in errors.
      cache_salt: the prefix-cache scope on the worker (see PrefillRequest.cache_salt).
      worker: the address of the model worker the request was routed to (`Backends.route`; every choice of a
        request goes to one worker); "" routes this generation by its prompt alone.
      reservation: the routed request's in-flight count on that worker (`workers.Reservation`), released when
        this generation ends; None: counted here.
      session: the request's session (`workers.Session` with its key set): the worker keeps its KV leased to it
        after this generation when it asks for a ttl; None: no session.
      prediction: the expected answer's token ids (OpenAI Predicted Outputs), drafts for the worker's speculative
        decoding; empty without one.
      draft_scope: whose finished answers the worker may draft from (the answer-history scope: tenant and
        cache_salt, gateway/backends/history.py).
      slo_ttft_s, slo_tpot_s: the request's latency targets in seconds (None: the worker's defaults).
      priority: admission order among the worker's waiting requests with the same deadline (vLLM's `priority`:
        lower first).
    """

    sampling: common_pb2.SamplingParams
    max_tokens: int
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    share_prompt_with: str | None = None
    constraint: Matcher | None = None
    initial_mask: bytes | None = None
    constraint_param: str = "response_format"
    cache_salt: str = ""
    worker: str = ""
    reservation: Reservation | None = None
    session: Session | None = None
    prediction: list[int] | None = None
    draft_scope: str = ""
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    priority: int = 0


@dataclasses.dataclass
class Delta:
    """Output since the previous delta; finish_reason and usage are set on the last one.

    Attributes:
      text: new text (after stop-string handling).
      token_ids, logprobs: the tokens counted in this delta.
      tokens: the same tokens as worker protos (top alternatives, forced flag).
      whole: (last delta) the text is exactly the detokenized generated tokens — no stop string cut it.
      stop_string: (last delta) the stop string that ended the answer, or None (Anthropic's `stop_sequence`).
      cached_tokens: prompt tokens whose KV the worker reused (known from the Prefill reply on, so on every
        delta: the Messages API reports it in `message_start`).
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    usage: common_pb2.Usage | None = None
    tokens: list[common_pb2.GeneratedToken] = dataclasses.field(default_factory=list)
    whole: bool = False
    stop_string: str | None = None
    cached_tokens: int = 0


class _AnswerText:
    """Per-request detokenization, stop strings and counting.

    The detokenizer is primed with the prompt's dangling bytes (a completions prompt given as token ids may end
    inside a character: gateway/generation/detokenizer.py), so an answer that completes that character emits it whole.
    Prompts from text or a chat template end on a character boundary, so priming changes nothing for them."""

    def __init__(self, backends: ModelFactsView, params: GenParams, prompt_ids: Sequence[int] = ()):
        facts = backends.ready_facts()
        self.detok = IncrementalDetokenizer(facts.token_bytes, facts.special_ids, params.skip_special_tokens)
        self.detok.prime(prompt_ids)
        self.stops = StopMatcher(params.stop)
        self.count = 0
        self.cached = 0
        self.prediction = list(params.prediction or [])
        self.predicted: tuple[int, int] | None = None  # the worker's (accepted, rejected), once it ended
        self.ids: list[int] = []
        self.done = False

    def feed(self, tokens: list[common_pb2.GeneratedToken]) -> Delta:
        """Consume tokens (ignoring any after a stop string matched)."""
        text, ids, lps, kept = "", [], [], []
        for t in tokens:
            if self.stops.stopped:
                break
            self.count += 1
            if self.prediction:  # kept only to count a prediction's tokens here (`_predicted_here`)
                self.ids.append(t.token_id)
            ids.append(t.token_id)
            lps.append(t.logprob)
            kept.append(t)
            text += self.stops.push(self.detok.push(t.token_id))
        return Delta(text=text, token_ids=ids, logprobs=lps, tokens=kept, cached_tokens=self.cached)

    def note_usage(self, usage: common_pb2.Usage) -> None:
        """The worker's counts on its last message (the prediction's accepted and rejected tokens)."""
        if self.prediction:
            self.predicted = (usage.accepted_prediction_tokens, usage.rejected_prediction_tokens)

    def _predicted_here(self) -> tuple[int, int]:
        """(accepted, rejected) prediction tokens when the worker's counts did not come (a stop string ended the
        answer here and the worker was aborted): the prediction's tokens the answer repeats from its start."""
        same = 0
        for a, b in zip(self.ids, self.prediction):
            if a != b:
                break
            same += 1
        return same, len(self.prediction) - same

    def close(self, delta: Delta, finish: int, prompt_tokens: int) -> Delta:
        """Mark the delta final: flush held text and attach the finish reason and usage."""
        if self.stops.stopped:
            reason = "stop"
        else:
            delta.text += self.stops.push(self.detok.flush())
            delta.text += self.stops.flush()
            reason = "stop" if self.stops.stopped else FINISH_NAMES.get(finish, "stop")
        delta.finish_reason = reason
        delta.whole = not self.stops.stopped
        delta.stop_string = self.stops.matched
        delta.usage = common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=self.count,
                                       cached_tokens=self.cached)
        if self.prediction:
            accepted, rejected = self.predicted or self._predicted_here()
            delta.usage.accepted_prediction_tokens, delta.usage.rejected_prediction_tokens = accepted, rejected
        self.done = True
        return delta


async def generate(
    backends: WorkerView, prompt_ids: list[int], params: GenParams, request_id: str | None = None
) -> AsyncIterator[Delta]:
    """Generate from prompt ids; yields Deltas, the last with finish_reason and usage.

    Raises:
      ApiError: validation (400), backend unavailable (503), queue full (429), a backend past its deadline
        (504), worker failure (500).
    """
    facts = backends.ready_facts()
    max_tokens = params.max_tokens  # decided by the planner (`answer_limit.answer_budget`); the worker checks it again
    rid = request_id or f"gen-{uuid.uuid4().hex}"
    stream = _AnswerText(backends, params, prompt_ids)
    clock = _Clock(backends, constrained=params.constraint is not None)
    prefill = model_worker_pb2.PrefillRequest(
        request_id=rid,
        prompt_token_ids=prompt_ids,
        sampling=params.sampling,
        stopping=common_pb2.StoppingParams(
            max_tokens=max_tokens, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos
        ),
        share_prompt_with=params.share_prompt_with or "",
        cache_salt=params.cache_salt,
        prediction_token_ids=params.prediction or [],
        draft_scope=params.draft_scope,
        slo_ttft_s=params.slo_ttft_s or 0.0,
        slo_tpot_s=params.slo_tpot_s or 0.0,
        priority=params.priority,
    )
    if params.session is not None:
        prefill.session_id = params.session.key
        prefill.session_ttl_s, prefill.session_release = params.session.ttl, params.session.release
    if params.allowed_token_ids is not None:
        prefill.allowed_tokens.allowed = allowed_mask_bytes(params.allowed_token_ids, facts.vocab_size)
    driver = None
    if params.constraint is not None:
        driver = ConstraintDriver(params.constraint, backends.metrics, params.constraint_param, max_tokens,
                                  context=prompt_ids)
        prefill.constrained = prefill.drafts_with_masks = True
        prefill.initial_mask.allowed = params.initial_mask if params.initial_mask is not None else \
            await asyncio.to_thread(driver.initial_mask)
    metrics = backends.metrics
    addr = params.worker or backends.route(None, prompt_ids, params.cache_salt, "")
    reservation = params.reservation or backends.pool.reserve(addr, 1)
    try:
        worker = _RoutedWorker(backends, addr)
        metrics.waiting.inc()
        try:
            reply = await worker.call(worker.stub.Prefill(prefill))
        finally:
            metrics.waiting.dec()
        metrics.running.inc()
        try:
            async for delta in _decode(worker, rid, reply, stream, clock, driver):
                yield delta
        finally:
            metrics.running.dec()
    finally:
        reservation.release()


class _RoutedWorker:
    """The worker one generation was routed to: its stub, and failover (an unreachable worker leaves the ring at
    once: `WorkerPool.mark_failed`)."""

    def __init__(self, backends: WorkerView, addr: str):
        self.backends, self.addr = backends, addr
        self.stub = backends.worker(addr)

    def failed(self, err: grpc.aio.AioRpcError) -> ApiError:
        """The ApiError of a failed call, noting an unreachable worker."""
        self._note(err)
        return from_rpc_error(err, "model worker")

    def _note(self, err: grpc.aio.AioRpcError) -> None:
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            self.backends.metrics.failovers.labels(self.addr).inc()
            self.backends.pool.mark_failed(self.addr)

    async def _noting(self, coro):
        try:
            return await coro
        except grpc.aio.AioRpcError as err:
            self._note(err)
            raise

    async def call(self, coro):
        """Await a unary RPC to this worker (through `Backends.call`).

        Raises:
          ApiError: the translated error.
        """
        return await self.backends.call("model worker", self._noting(coro))


async def _decode(worker: _RoutedWorker, rid: str, reply: model_worker_pb2.PrefillResponse, stream: _AnswerText,
                  clock: _Clock, driver: ConstraintDriver | None) -> AsyncIterator[Delta]:
    """The rest of a generation after its Prefill reply: the Decode stream, the constraint's masks, the deltas."""
    prompt_tokens = reply.usage.prompt_tokens
    stream.cached = reply.usage.cached_tokens
    if reply.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
        stream.note_usage(reply.usage)
    delta = clock.tick(stream.feed([reply.first_token]))
    if reply.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED or stream.stops.stopped:
        if stream.stops.stopped and reply.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
            await _abort(worker, rid)
        clock.done()
        yield stream.close(delta, reply.finish_reason, prompt_tokens)
        return
    backends = worker.backends
    call = worker.stub.Decode()
    try:
        await call.write(model_worker_pb2.DecodeRequest(request_id=rid))
        if driver is not None:
            driver.max_draft = reply.max_draft_tokens
            for message in await asyncio.to_thread(driver.on_tokens, [reply.first_token]):
                await call.write(message)
        if delta.text or delta.token_ids:
            yield delta
        while (msg := await _next_message(call, backends.timeouts.worker)) is not grpc.aio.EOF:
            if driver is not None and msg.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                driver.max_draft = msg.max_draft_tokens
                # Off the event loop: a mask costs up to llguidance's per-token budget (figures: docs/performance.md).
                for message in await asyncio.to_thread(driver.on_tokens, list(msg.tokens)):
                    await call.write(message)
            delta = clock.tick(stream.feed(msg.tokens))
            if stream.stops.stopped:
                clock.done()
                yield stream.close(delta, common_pb2.FINISH_REASON_STOP, prompt_tokens)
                return
            if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                if msg.finish_reason == common_pb2.FINISH_REASON_ABORT:
                    raise ApiError(500, "the model worker aborted the request", code="aborted")
                _count_budget_ending(backends, driver, msg.finish_reason)
                stream.note_usage(msg.usage)
                clock.done()
                yield stream.close(delta, msg.finish_reason, prompt_tokens)
                return
            if delta.text or delta.token_ids:
                yield delta
        raise ApiError(500, "the model worker closed the stream early", code="backend_error")
    except grpc.aio.AioRpcError as err:
        raise worker.failed(err) from None
    finally:
        call.cancel()
        if not stream.done or stream.stops.stopped:
            await _abort(worker, rid)


def _count_budget_ending(backends: WorkerView, driver: ConstraintDriver | None, finish: int) -> None:
    """Count an answer that ended with a stop after the budget capped its units (gateway/structured/budget.py)."""
    capped = getattr(driver.c, "capped", None) if driver is not None else None
    if capped is not None and capped() and finish == common_pb2.FINISH_REASON_STOP:
        backends.metrics.budget_endings.labels(driver.c.kind).inc()


async def _next_message(call, idle: float):
    """The next message of a Decode stream (grpc.aio.EOF at its end).

    Raises:
      ApiError: 504 when the worker sends nothing for `idle` seconds (a step never takes that long).
    """
    try:
        return await asyncio.wait_for(call.read(), idle)
    except TimeoutError:
        raise ApiError(504, f"the model worker sent nothing for {idle:g} s", code="backend_timeout") from None


FORCED_RUN_MIN = 12
"""Shortest forced run sent as a run. A run is computed in a batch-1 compute step (a 64-token chunk) that the
other rows wait for, while a one-token mask keeps the row in the batched decode step at a small marginal cost per
row: on CPU runs pay off from ~12 tokens (figures: docs/performance.md)."""


class ConstraintDriver:
    """Drives a request's grammar from the gateway: the first mask goes with Prefill; then, for every token the
    worker streams back, the matcher advances and the next step's instruction goes out on the Decode stream — a
    run of forced tokens when the grammar allows exactly one continuation for at least FORCED_RUN_MIN tokens
    (the worker computes them in compute steps, one per chunk; shorter runs go token by token as one-token
    masks, so the row stays in the batched decode step), then the mask for the token after them. Once the
    grammar is complete the mask allows only the stop ids.

    Drafts (speculative decoding, when the worker takes them: `max_draft`). With each mask goes a draft: the
    tokens the grammar forces next, else the continuation of the latest earlier occurrence of the last few
    tokens of the prompt and answer (`common.ngram.NgramIndex`), each checked against the mask before it, with
    the mask that holds once it is taken — computed by the same rule (`_instruction`) on a fork of the grammar,
    so a verified draft gives exactly the masks, and so the tokens, that step-by-step decoding would. A draft
    ends at a token its mask refuses, a stop id, or a step where a forced run would go as a run.
    """

    def __init__(self, constraint, metrics=None, param: str = "response_format", max_tokens: int | None = None,
                 context: Sequence[int] = ()):
        """Args: constraint: the request's grammar state; metrics: GatewayMetrics to count tokens in, or None;
        param: the request field the grammar comes from (named when the grammar exceeds its budget); max_tokens:
        the generation's limit — nothing is sent for a step at or past it (the worker ends the stream there, and
        a message written after that end would fail the call); context: the prompt's token ids (drafts are
        looked up in them and in the answer)."""
        self.c = constraint
        self.max_tokens = max_tokens
        self.metrics = metrics
        self.param = param
        self.received = 0  # tokens received from the worker (= index of the next one)
        self.sent_for = 0  # step for which the next mask has been sent
        self.forced_pending = 0
        self.forced_count = 0
        self.max_draft = 0  # the worker's latest hint (PrefillResponse / DecodeResponse `max_draft_tokens`)
        self.drafted = 0  # draft tokens sent
        self._context = list(context)
        self._answer: list[int] = []  # tokens received
        self._runs: list[int] = []  # tokens of the forced runs sent (the last `forced_pending` not received yet)
        self._index: NgramIndex | None = None  # prompt + answer, built at the first draft (off the event loop)
        self._stops = frozenset(_stop_ids(constraint))

    def initial_mask(self) -> bytes:
        """The mask of token 0."""
        return self.c.mask()

    def on_tokens(self, tokens: list[common_pb2.GeneratedToken]) -> list[model_worker_pb2.DecodeRequest]:
        """Advance over received tokens; returns the Decode-stream messages to send next.

        Raises:
          ApiError: 500 if the worker produced a token the grammar does not allow; 400 naming the request field
            when the grammar needs more than llguidance's budget for the next mask.
        """
        try:
            return self._on_tokens(tokens)
        except ConstraintError as err:
            raise ApiError(400, f"{self.param}: the grammar exceeded its budget while generating: {err}",
                           param=self.param, code="grammar_budget_exceeded") from None

    def _on_tokens(self, tokens: list[common_pb2.GeneratedToken]) -> list[model_worker_pb2.DecodeRequest]:
        for t in tokens:
            self.received += 1
            self._answer.append(t.token_id)
            if self._index is not None:
                self._index.extend([t.token_id])
            if t.forced and self.forced_pending:
                self.forced_pending -= 1  # already consumed when the run was sent
                continue
            try:
                self.c.advance(t.token_id)
            except ValueError as err:
                if "grammar error" in str(err):
                    raise
                raise ApiError(500, f"the model produced a token the grammar forbids: {err}", code="constraint") from None
        if self.received <= self.sent_for:
            return []
        step = self.received
        messages = []
        kind, value = self._instruction(self.c, step)
        if self.metrics is not None and kind != "mask":
            self.metrics.forced_tokens.inc(1 if kind == "single" else len(value))
        if kind == "single":
            self.forced_count += 1
        elif kind == "run":
            for token in value:
                self.c.advance(token)
            messages.append(model_worker_pb2.DecodeRequest(step=step, forced=model_worker_pb2.ForcedTokens(
                token_ids=value)))
            self.forced_pending += len(value)
            self.forced_count += len(value)
            self._runs += value
            if self.metrics is not None:
                self.metrics.forced_runs.inc()
                self.metrics.forced_run_tokens.inc(len(value))
            step += len(value)
            # (a forced run may end with the grammar's own stop token, or at max_tokens)
            kind, value = ("mask", None) if self._ends(self.c, step) else ("mask", self.c.mask())
        if value is not None:
            mask = value if kind == "mask" else allowed_mask_bytes([value[0]], self.c.vocab_size)
            message = model_worker_pb2.DecodeRequest(step=step, mask=common_pb2.TokenMask(allowed=mask))
            self._draft(message, step, kind, value)
            messages.append(message)
        self.sent_for = step
        return messages

    def _ends(self, c, step: int) -> bool:
        """Whether nothing is sent for token number `step`: the grammar consumed its stop token, or the step is
        at max_tokens."""
        return c.finished() or (self.max_tokens is not None and step >= self.max_tokens)

    def _instruction(self, c, step: int) -> tuple[str, object]:
        """What goes out for token number `step` of a grammar in state `c` (the live one, or a draft's fork):
        ("run", forced tokens) for a forced run of at least FORCED_RUN_MIN tokens (fewer once cut at
        max_tokens: then token by token); ("single", forced tokens) for a shorter one, sent as a one-token mask;
        ("mask", the mask bytes) otherwise, or ("mask", None) when nothing is sent (`_ends`)."""
        if self._ends(c, step):
            return "mask", None
        forced = [] if c.done() else list(c.forced())
        if self.max_tokens is not None:
            forced = forced[: self.max_tokens - step]
        if len(forced) >= FORCED_RUN_MIN:
            return "run", forced
        if forced:
            return "single", forced
        return "mask", c.mask()

    def _draft(self, message: model_worker_pb2.DecodeRequest, step: int, kind: str, value) -> None:
        """Attach a draft from token number `step` on (class docstring) to `message`, the mask of that step."""
        k = self.max_draft
        if self.max_tokens is not None:
            k = min(k, self.max_tokens - step - 1)
        if k <= 0:
            return
        if self._index is None:
            self._index = NgramIndex(self._context + self._answer)
        ahead = self._runs[len(self._runs) - self.forced_pending:]  # sent as a run, not received yet
        tokens: list[int] = []
        masks: list[bytes] = []
        fork = None
        for i in range(k):
            guess = value[0] if kind == "single" else self._guess(ahead + tokens)
            if guess is None or guess in self._stops or (kind == "mask" and not _allows(value, guess)):
                break
            fork = fork or self.c.fork()
            try:
                fork.advance(guess)
            except ValueError:
                break
            kind, value = self._instruction(fork, step + i + 1)
            if kind == "run" or value is None:
                break  # no sampled step there: the draft ends before it
            tokens.append(guess)
            masks.append(value if kind == "mask" else allowed_mask_bytes([value[0]], self.c.vocab_size))
        if tokens:
            self.drafted += len(tokens)
            message.draft.token_ids.extend(tokens)
            message.draft.masks.extend(common_pb2.TokenMask(allowed=m) for m in masks)

    def _guess(self, drafted: list[int]) -> int | None:
        """The next token after the answer so far and `drafted` (tokens not received yet), looked up in the
        prompt and answer; None without a match."""
        index = self._index
        assert index is not None
        tail = (index.tokens[-NGRAM_MAX:] + drafted)[-NGRAM_MAX:]
        _, ahead = index.lookup(tail, 1)
        return ahead[0] if ahead else None


def _stop_ids(c) -> list[int]:
    """The stop ids of a constraint, through its wrappers (`inner`): never drafted (a draft does not end the
    answer)."""
    while c is not None and not hasattr(c, "stop_ids"):
        c = getattr(c, "inner", None)
    return list(getattr(c, "stop_ids", ()))


def _allows(mask: bytes, token: int) -> bool:
    """Whether a TokenMask bitset allows `token`."""
    return 0 <= token < len(mask) * 8 and bool(mask[token >> 3] >> (token & 7) & 1)


class _Clock:
    """Client-facing latency metrics of one generation (TTFT, inter-token, end to end)."""

    def __init__(self, backends: WorkerView, constrained: bool = False):
        self.metrics = backends.metrics
        self.start = self.last = time.monotonic()
        self.first = True
        self.constrained = constrained

    def tick(self, delta: Delta) -> Delta:
        now = time.monotonic()
        n = len(delta.token_ids)
        if n:
            if self.first:
                self.metrics.ttft.observe(now - self.start)
                self.first = False
            else:
                for _ in range(n):
                    self.metrics.itl.observe((now - self.last) / n)
            self.last = now
            self.metrics.tokens.inc(n)
            if self.constrained:
                self.metrics.constrained_tokens.inc(n)
        return delta

    def done(self) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.start)


def allowed_mask_bytes(token_ids: list[int], vocab_size: int) -> bytes:
    """A TokenMask bitset (bit i of byte i // 8, LSB first) allowing exactly `token_ids`.

    Raises:
      ApiError: 400 for an empty list or an id out of range.
    """
    if not token_ids:
        raise ApiError(400, "allowed_token_ids must not be empty", param="allowed_token_ids")
    bits = bytearray((vocab_size + 7) // 8)
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise ApiError(400, f"allowed token id {t} is out of range [0, {vocab_size})", param="allowed_token_ids")
        bits[t // 8] |= 1 << (t % 8)
    return bytes(bits)


async def _abort(worker: _RoutedWorker, rid: str) -> None:
    """Best-effort Abort (the request may already have ended)."""
    try:
        await worker.stub.Abort(model_worker_pb2.AbortRequest(request_id=rid), timeout=5)
    except grpc.aio.AioRpcError as err:
        log.debug("abort of %s failed: %s", rid, err)

"""The worker's gRPC servicer: proto <-> Sequence, one asyncio queue per live request. No model logic here.

Events flow engine thread -> `Sequence.sink` -> `loop.call_soon_threadsafe` -> the request's asyncio.Queue ->
the Prefill reply (first token) or the Decode stream (the rest). A request whose Decode stream does not attach
within `attach_timeout` seconds after Prefill, or whose stream is cancelled, is aborted, so no slot leaks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from model_worker.serving.loop import ENGINE_FAILED, EngineLoop
from model_worker.serving.sampling_settings import (
    MAX_LOGIT_BIAS,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    mask_words_from_bytes,
)
from model_worker.serving.sequence import Failure, Finish, GrammarDraft, SamplingSpec, Sequence, TokenEvent
from protos import common_pb2, model_worker_pb2, model_worker_pb2_grpc

if TYPE_CHECKING:
    from model_worker.engine.engine import EngineConfig
    from model_worker.modeling.config import ModelConfig

log = logging.getLogger(__name__)
SERVICE_NAME = "gemma_serve.v1.ModelWorker"


class RequestError(Exception):
    """A request the worker refuses: carries the gRPC status code and a message for the client."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


#: Most draft tokens one Decode-stream message may carry (their masks are ~32 KB each over a 262k vocabulary);
#: the worker verifies at most its own `--max-draft-tokens` of them.
MAX_DRAFT_MESSAGE = 64


@dataclasses.dataclass
class _Live:
    """Servicer-side state of one live request."""

    queue: asyncio.Queue
    prompt_tokens: int
    generated: int = 0
    attached: bool = False
    timer: asyncio.TimerHandle | None = None
    drafts: bool = False  # its client sends drafts with its masks: replies carry `max_draft_tokens`


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def sampling_from_pb(sp: common_pb2.SamplingParams, vocab_size: int) -> SamplingSpec:
    """Validate and convert SamplingParams.

    Raises:
      RequestError: INVALID_ARGUMENT naming the out-of-range value.
    """
    finite = all(math.isfinite(x) for x in (sp.temperature, sp.top_p, sp.min_p, sp.presence_penalty,
                                            sp.frequency_penalty, sp.repetition_penalty))
    _check(finite, "sampling values must be finite numbers")
    _check(sp.temperature >= 0, f"temperature must be >= 0, got {sp.temperature}")
    _check(0 <= sp.top_k <= MAX_TOP_K, f"top_k must be in [0, {MAX_TOP_K}], got {sp.top_k}")
    _check(0 <= sp.top_p <= 1, f"top_p must be in (0, 1], got {sp.top_p}")
    _check(0 <= sp.min_p < 1, f"min_p must be in [0, 1), got {sp.min_p}")
    _check(-2 <= sp.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {sp.presence_penalty}")
    _check(-2 <= sp.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {sp.frequency_penalty}")
    _check(sp.repetition_penalty >= 0, f"repetition_penalty must be > 0, got {sp.repetition_penalty}")
    _check(len(sp.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias has more than {MAX_LOGIT_BIAS} entries")
    for tid, bias in sp.logit_bias.items():
        _check(0 <= tid < vocab_size, f"logit_bias token id {tid} is out of range [0, {vocab_size})")
        _check(math.isfinite(bias) and -100 <= bias <= 100, f"logit_bias values must be in [-100, 100], got {bias}")
    _check(0 <= sp.top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    seed = sp.seed if sp.HasField("seed") else random.getrandbits(64)
    bias = sorted(sp.logit_bias.items())
    return SamplingSpec(
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p if sp.top_p > 0 else 1.0,
        min_p=sp.min_p,
        seed=seed,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty if sp.repetition_penalty > 0 else 1.0,
        bias_ids=tuple(t for t, _ in bias),
        bias_vals=tuple(v for _, v in bias),
        top_logprobs=sp.top_logprobs,
    )


def mask_from_pb(mask: common_pb2.TokenMask, vocab_size: int):
    """TokenMask -> packed uint32 words.

    Raises:
      RequestError: INVALID_ARGUMENT for a wrong length.
    """
    expected = (vocab_size + 7) // 8
    _check(len(mask.allowed) == expected, f"a token mask must have {expected} bytes, got {len(mask.allowed)}")
    return mask_words_from_bytes(mask.allowed, vocab_size)


def tokens_pb(ev: TokenEvent) -> list[common_pb2.GeneratedToken]:
    """The event's tokens as protos (with alternatives when requested, and the forced flag)."""
    out = []
    for j, token in enumerate(ev.token_ids):
        pb = common_pb2.GeneratedToken(token_id=token, logprob=ev.logprobs[j],
                                       forced=ev.forced[j] if ev.forced else False)
        if ev.top and ev.top[j][0]:
            pb.top_logprobs.extend(common_pb2.TopLogprob(token_id=t, logprob=lp)
                                   for t, lp in zip(*ev.top[j]) if t >= 0)
        out.append(pb)
    return out


_STATUS_OF_FAILURE = {
    Failure.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,  # retry later
    Failure.SLO_UNREACHABLE: grpc.StatusCode.RESOURCE_EXHAUSTED,  # retry later (the message says when)
    Failure.ENGINE_FAILED: grpc.StatusCode.UNAVAILABLE,  # retry after the restart
}


def _error_code(failure: Failure) -> grpc.StatusCode:
    """The status of a sequence that ended with an error of kind `failure`: a full queue and a failed engine
    (restarting) can be retried; anything else is the worker's own failure."""
    return _STATUS_OF_FAILURE.get(failure, grpc.StatusCode.INTERNAL)


def engine_facts(cfg: ModelConfig, ecfg: EngineConfig) -> dict[str, object]:
    """The engine facts of the Info reply (`WorkerInfoResponse` fields 14-18) as keyword arguments: sliding
    window (0 without sliding layers), prefix caching (always on: slots keep their KV), the model's own context
    limit, the KV storage dtype and the prompt chunk lengths. Clients size and explain requests from them
    without knowing the checkpoint (TGI's InfoResponse does the same)."""
    sliding = any(spec.attention == "sliding" for spec in cfg.layers)
    return {
        "sliding_window": cfg.sliding_window if sliding else 0,
        "prefix_caching": True,
        "max_position_embeddings": cfg.max_position_embeddings,
        "kv_cache_dtype": "int8" if ecfg.kv_int8 else "bfloat16" if cfg.batch_invariant else ecfg.dtype,
        "prefill_chunks": sorted(ecfg.prefill_chunks),
    }


class WorkerServicer(model_worker_pb2_grpc.ModelWorkerServicer):
    """ModelWorker RPCs over an EngineLoop (None until the engine is ready)."""

    def __init__(self, info: model_worker_pb2.WorkerInfoResponse, attach_timeout: float = 30.0,
                 max_session_ttl: float = 600.0):
        """Args: info: the Info reply (updated when ready); attach_timeout: seconds a prefilled request may wait
        for its Decode stream before it is aborted; max_session_ttl: the longest session lease granted (seconds;
        a request asking more gets this; 0 grants none)."""
        self.info = info
        self.max_session_ttl = max_session_ttl
        self.loop: EngineLoop | None = None
        self.attach_timeout = attach_timeout
        self._live: dict[str, _Live] = {}
        self.draining = False  # set on SIGTERM: new requests are refused, running ones finish
        self.programs_compiling = 0  # programs of the grid still compiling while the worker serves (GetLoad)

    def set_ready(self, loop: EngineLoop, info: model_worker_pb2.WorkerInfoResponse) -> None:
        """Start accepting requests (called once the engine is compiled)."""
        self.info, self.loop = info, loop

    # ----- RPCs -----------------------------------------------------------------------------------------------
    async def Info(self, request, context):
        """The model's and the engine's facts (sizes, limits, `engine_facts`), set by `set_ready`."""
        return self.info

    async def GetLoad(self, request, context):
        """Waiting and running requests now, the KV usage of the engine loop's latest iteration
        (`EngineLoop.load`: a router's load signal), the headroom within latency targets
        (`EngineLoop.headroom`) and the programs still compiling; UNAVAILABLE until the engine is ready."""
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model worker is still loading")
        running, waiting, kv_usage = self.loop.load()
        return model_worker_pb2.GetLoadResponse(num_requests_waiting=waiting, num_requests_running=running,
                                                kv_cache_usage_perc=kv_usage, num_slots=self.loop.engine.ecfg.num_slots,
                                                headroom_rows=self.loop.headroom(),
                                                programs_compiling=self.programs_compiling)

    async def Prefill(self, request: model_worker_pb2.PrefillRequest, context):
        events: asyncio.Queue = asyncio.Queue()
        aio_loop = asyncio.get_running_loop()
        try:
            seq = self._sequence_from_pb(request, lambda ev: aio_loop.call_soon_threadsafe(events.put_nowait, ev))
        except RequestError as err:
            await context.abort(err.code, err.message)
        live = _Live(queue=events, prompt_tokens=len(seq.prompt), drafts=seq.drafts_with_masks)
        self._live[seq.request_id] = live
        self.loop.submit(seq)
        try:
            ev: TokenEvent = await live.queue.get()
        except asyncio.CancelledError:
            self._drop(seq.request_id, abort=True)
            raise
        if ev.error:
            self._drop(seq.request_id, abort=False)
            await context.abort(_error_code(ev.failure), ev.error)
        live.generated = len(ev.token_ids)
        if ev.finish != Finish.NONE:
            self._drop(seq.request_id, abort=False)
        else:
            live.timer = aio_loop.call_later(self.attach_timeout, self._attach_expired, seq.request_id)
        return model_worker_pb2.PrefillResponse(
            request_id=seq.request_id,
            first_token=tokens_pb(ev)[0] if ev.token_ids else None,
            finish_reason=int(ev.finish),
            usage=common_pb2.Usage(prompt_tokens=live.prompt_tokens, completion_tokens=live.generated,
                                   cached_tokens=ev.cached_tokens, accepted_prediction_tokens=ev.accepted_prediction,
                                   rejected_prediction_tokens=ev.rejected_prediction),
            max_draft_tokens=self.loop.draft_hint() if seq.drafts_with_masks else 0,
        )

    async def Decode(self, request_iterator, context):
        first = await context.read()
        rid = first.request_id if first is not grpc.aio.EOF else ""
        live = self._live.get(rid)
        if live is None or live.attached:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no live request {rid!r} awaiting Decode")
        live.attached = True
        if live.timer:
            live.timer.cancel()
        try:
            self._constraint(rid, first)
        except RequestError as err:
            self._drop(rid, abort=True)
            await context.abort(err.code, err.message)
        reader = asyncio.ensure_future(self._read_client(context, rid, live))
        finished = False
        try:
            while not finished:
                events = [await live.queue.get()]
                while not live.queue.empty():
                    events.append(live.queue.get_nowait())
                reply, finished, error = self._decode_reply(live, events)
                if error is not None:
                    await context.abort(_error_code(error.failure), error.error)
                yield reply
        finally:
            reader.cancel()
            self._drop(rid, abort=not finished)

    async def Abort(self, request, context):
        found = request.request_id in self._live
        self._drop(request.request_id, abort=True)
        return model_worker_pb2.AbortResponse(found=found)

    # ----- helpers --------------------------------------------------------------------------------------------
    def _sequence_from_pb(self, request: model_worker_pb2.PrefillRequest,
                          sink: Callable[[TokenEvent], None]) -> Sequence:
        if self.loop is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the model worker is still loading")
        if self.loop.failed is not None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, ENGINE_FAILED)
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the model worker is shutting down")
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        info = self.info
        if not rid:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if rid in self._live:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already live")
        if not prompt:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < info.vocab_size]
        if bad:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"token id {bad[0]} is out of range [0, {info.vocab_size})"
            )
        max_tokens = request.stopping.max_tokens
        if max_tokens < 1:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"max_tokens must be >= 1, got {max_tokens}")
        if len(prompt) + max_tokens > info.max_model_len:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = {len(prompt) + max_tokens} exceeds "
                f"max_model_len {info.max_model_len}",
            )
        _check(math.isfinite(request.session_ttl_s), "session_ttl_s must be a finite number of seconds")
        _check(len(request.session_id) <= 256, "session_id is longer than 256 characters")
        _check(not request.constrained or request.HasField("initial_mask"),
               "a constrained request needs initial_mask for its first token")
        prediction = list(request.prediction_token_ids)
        _check(len(prediction) <= info.max_model_len,
               f"the prediction has {len(prediction)} tokens, more than max_model_len {info.max_model_len}")
        _check(all(0 <= t < info.vocab_size for t in prediction),
               f"prediction token ids must be in [0, {info.vocab_size})")
        _check(len(request.draft_scope) <= 1024, "draft_scope is longer than 1024 characters")
        for name in ("slo_ttft_s", "slo_tpot_s"):
            value = getattr(request, name)
            _check(math.isfinite(value) and value >= 0, f"{name} must be a finite number of seconds >= 0")
        stop = set(request.stopping.stop_token_ids)
        if not request.stopping.ignore_eos:
            stop |= set(info.default_stop_token_ids)
        initial, allowed = request.HasField("initial_mask"), request.HasField("allowed_tokens")
        # Built whole: once created, a sequence changes only in the scheduler (docs/architecture.md).
        return Sequence(
            request_id=rid,
            prompt=prompt,
            sampling=sampling_from_pb(request.sampling, info.vocab_size),
            max_tokens=max_tokens,
            stop_ids=frozenset(stop),
            sink=sink,
            constrained=request.constrained,
            fork_of=request.share_prompt_with or None,
            masks={0: mask_from_pb(request.initial_mask, info.vocab_size)} if initial else {},
            allowed=mask_from_pb(request.allowed_tokens, info.vocab_size) if allowed else None,
            cache_salt=request.cache_salt,
            draft_scope=request.draft_scope,
            drafts_with_masks=request.constrained and request.drafts_with_masks,
            prediction=prediction,
            session=request.session_id,
            lease_ttl=0.0 if request.session_release else min(max(request.session_ttl_s, 0.0), self.max_session_ttl),
            slo_ttft_s=request.slo_ttft_s or None,
            slo_tpot_s=request.slo_tpot_s or None,
            priority=request.priority,
        )

    def _constraint(self, rid: str, msg: model_worker_pb2.DecodeRequest) -> None:
        """Hand a Decode-stream mask or forced-token run to the engine loop.

        Raises:
          RequestError: INVALID_ARGUMENT for a malformed mask, bad token ids or a negative step.
        """
        kind = msg.WhichOneof("constraint")
        if kind is None:
            return
        _check(msg.step >= 0, f"step must be >= 0, got {msg.step}")
        if kind == "mask":
            self.loop.add_mask(rid, msg.step, mask_from_pb(msg.mask, self.info.vocab_size), self._draft(msg))
        else:
            ids = list(msg.forced.token_ids)
            _check(bool(ids) and all(0 <= t < self.info.vocab_size for t in ids),
                   f"forced token ids must be non-empty and in [0, {self.info.vocab_size})")
            self.loop.add_forced(rid, msg.step, ids)

    def _draft(self, msg: model_worker_pb2.DecodeRequest) -> GrammarDraft | None:
        """A mask message's draft (`ConstrainedDraft`) as the loop takes it, or None.

        Raises:
          RequestError: INVALID_ARGUMENT for a draft with bad token ids, a mask per token missing, or more tokens
            than any verify step takes.
        """
        if not msg.HasField("draft") or not msg.draft.token_ids:
            return None
        ids, most = list(msg.draft.token_ids), max(self.loop.scheduler.max_draft_tokens, 0)
        _check(all(0 <= t < self.info.vocab_size for t in ids), f"draft token ids must be in [0, {self.info.vocab_size})")
        _check(len(msg.draft.masks) == len(ids), f"a draft of {len(ids)} tokens needs {len(ids)} masks, "
                                                 f"got {len(msg.draft.masks)}")
        _check(len(ids) <= MAX_DRAFT_MESSAGE, f"a draft has at most {MAX_DRAFT_MESSAGE} tokens, got {len(ids)}")
        if most == 0:
            return None  # speculation is off: masks alone
        return GrammarDraft(msg.step, ids[:most], [mask_from_pb(m, self.info.vocab_size) for m in msg.draft.masks[:most]])

    def _decode_reply(self, live: _Live, events: list[TokenEvent]):
        tokens, finish, error, last = [], Finish.NONE, None, events[-1]
        for ev in events:
            tokens += tokens_pb(ev)
            finish = ev.finish if ev.finish != Finish.NONE else finish
            error = ev if ev.error else error
            last = ev if ev.finish != Finish.NONE else last
        live.generated += len(tokens)
        reply = model_worker_pb2.DecodeResponse(tokens=tokens, finish_reason=int(finish),
                                                max_draft_tokens=self.loop.draft_hint() if live.drafts else 0)
        if finish != Finish.NONE:
            reply.usage.CopyFrom(
                common_pb2.Usage(prompt_tokens=live.prompt_tokens, completion_tokens=live.generated,
                                 accepted_prediction_tokens=last.accepted_prediction,
                                 rejected_prediction_tokens=last.rejected_prediction)
            )
        return reply, finish != Finish.NONE, error

    async def _read_client(self, context, rid: str, live: _Live) -> None:
        """Forward later client messages (masks, forced tokens); a malformed one aborts the request."""
        while (msg := await context.read()) is not grpc.aio.EOF:
            if msg.request_id and msg.request_id != rid:
                continue
            try:
                self._constraint(rid, msg)
            except RequestError as err:
                self.loop.abort(rid)
                # the gateway is the only client: its malformed message is a worker-side failure (INTERNAL)
                live.queue.put_nowait(TokenEvent([], [], Finish.ABORT, error=err.message,
                                                 failure=Failure.BAD_MESSAGE))
                return

    def _attach_expired(self, rid: str) -> None:
        live = self._live.get(rid)
        if live is not None and not live.attached:
            log.warning("request %s: no Decode stream within %.0f s; aborting", rid, self.attach_timeout)
            self._drop(rid, abort=True)

    def _drop(self, rid: str, abort: bool) -> None:
        live = self._live.pop(rid, None)
        if live is not None and live.timer:
            live.timer.cancel()
        if live is not None and abort and self.loop is not None:
            self.loop.abort(rid)


"""The worker's gRPC contract on a real server (in-process, free port) over a hand-computable FakeEngine."""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time

import grpc
import numpy as np
import pytest

from model_worker.server.service import WorkerServicer
from model_worker.serving.loop import EngineLoop, wait_idle
from protos import common_pb2, model_worker_pb2, model_worker_pb2_grpc
from tests.fakes import FakeEngine, FakeEngineConfig
from tests.transport import grpc_listen

MAX_LEN = 64


_LOOP: asyncio.AbstractEventLoop | None = None


def _shared_loop() -> asyncio.AbstractEventLoop:
    """One event loop thread for every server in this module (grpc.aio binds its poller to one loop)."""
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        threading.Thread(target=_LOOP.run_forever, daemon=True).start()
    return _LOOP


class Server:
    """A grpc.aio server with a WorkerServicer on the shared event loop, and a sync client stub."""

    def __init__(self, engine: FakeEngine | None, attach_timeout: float = 30.0, **facts):
        """`facts`: more WorkerInfoResponse fields for the Info reply."""
        self.loop = _shared_loop()
        self.info = model_worker_pb2.WorkerInfoResponse(
            model_name="fake", vocab_size=engine.vocab if engine else 1000, max_model_len=MAX_LEN,
            num_slots=2, default_stop_token_ids=[999], **facts,
        )
        self.servicer = WorkerServicer(model_worker_pb2.WorkerInfoResponse(), attach_timeout=attach_timeout)
        self.engine_loop = EngineLoop(engine) if engine else None
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = model_worker_pb2_grpc.ModelWorkerStub(self.channel)

    async def _start(self):
        self.server = grpc.aio.server()
        model_worker_pb2_grpc.add_ModelWorkerServicer_to_server(self.servicer, self.server)
        self.address = grpc_listen(self.server, name="worker")  # a loopback port, or a unix socket without TCP
        await self.server.start()
        if self.engine_loop:
            self.engine_loop.start()
            self.servicer.set_ready(self.engine_loop, self.info)

    def close(self):
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        if self.engine_loop:
            self.engine_loop.stop()


@pytest.fixture
def engine():
    return FakeEngine(FakeEngineConfig(num_slots=2, max_model_len=MAX_LEN, chunk=4))


@pytest.fixture
def server(engine):
    s = Server(engine)
    yield s
    s.close()


def prefill(stub, rid, prompt, max_tokens=5, stop=(), **sampling):
    return stub.Prefill(model_worker_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(**sampling),
        stopping=common_pb2.StoppingParams(max_tokens=max_tokens, stop_token_ids=list(stop))))


def decode_all(stub, rid):
    tokens, last = [], None
    for msg in stub.Decode(iter([model_worker_pb2.DecodeRequest(request_id=rid)])):
        tokens += [t.token_id for t in msg.tokens]
        last = msg
    return tokens, last


def test_prefill_then_decode_stream(server):
    first = prefill(server.stub, "a", [10, 11, 12, 13, 14, 15], max_tokens=5)
    assert first.first_token.token_id == 16 and first.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert first.usage.prompt_tokens == 6 and first.usage.completion_tokens == 1
    tokens, last = decode_all(server.stub, "a")
    assert tokens == [17, 18, 19, 20]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (6, 5)


def test_stop_ids_end_the_sequence_and_are_counted(server):
    prefill(server.stub, "s", [1, 2], max_tokens=20, stop=[6])
    tokens, last = decode_all(server.stub, "s")
    assert tokens == [4, 5, 6] and last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert last.usage.completion_tokens == 4
    # The model's default stop ids (999 here) apply too.
    first = prefill(server.stub, "d", [997], max_tokens=20)
    assert first.first_token.token_id == 998
    tokens, last = decode_all(server.stub, "d")
    assert tokens == [999] and last.finish_reason == common_pb2.FINISH_REASON_STOP


def test_first_token_can_finish(server):
    r = prefill(server.stub, "one", [5], max_tokens=1)
    assert r.finish_reason == common_pb2.FINISH_REASON_LENGTH and r.first_token.token_id == 6
    with pytest.raises(grpc.RpcError) as err:
        decode_all(server.stub, "one")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    "kwargs, code, fragment",
    [
        (dict(prompt=[]), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (dict(prompt=[1, 1000]), grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
        (dict(prompt=[1] * 60, max_tokens=10), grpc.StatusCode.INVALID_ARGUMENT, "60 tokens) + max_tokens (10) = 70"),
        (dict(prompt=[1], max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (dict(prompt=[1], temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (dict(prompt=[1], top_k=5000), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
        (dict(prompt=[1], presence_penalty=3.0), grpc.StatusCode.INVALID_ARGUMENT, "presence_penalty"),
        (dict(prompt=[1], top_logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs"),
        (dict(prompt=[1], logit_bias={5000: 1.0}), grpc.StatusCode.INVALID_ARGUMENT, "logit_bias token id 5000"),
        (dict(prompt=[1], logit_bias={5: 101.0}), grpc.StatusCode.INVALID_ARGUMENT, "[-100, 100]"),
    ],
)
def test_prefill_validation(server, kwargs, code, fragment):
    with pytest.raises(grpc.RpcError) as err:
        prefill(server.stub, "bad", **kwargs)
    assert err.value.code() == code and fragment in err.value.details()


def test_duplicate_live_id_and_bad_masks_rejected(server, engine):
    engine.gate.clear()  # hold the engine so "x" stays live
    future = server.stub.Prefill.future(model_worker_pb2.PrefillRequest(
        request_id="x", prompt_token_ids=[1], stopping=common_pb2.StoppingParams(max_tokens=3)))
    deadline = time.monotonic() + 10
    while "x" not in server.engine_loop.scheduler.by_id:  # wait for "x" to be live, however slow the machine
        assert time.monotonic() < deadline, "x never reached the scheduler"
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as err:
        prefill(server.stub, "x", [1])
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    engine.gate.set()
    future.result(5)
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Prefill(model_worker_pb2.PrefillRequest(
            request_id="m", prompt_token_ids=[1], stopping=common_pb2.StoppingParams(max_tokens=3),
            initial_mask=common_pb2.TokenMask(allowed=b"\x01")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "125 bytes" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Prefill(model_worker_pb2.PrefillRequest(
            request_id="c", prompt_token_ids=[1], stopping=common_pb2.StoppingParams(max_tokens=3), constrained=True))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "initial_mask" in err.value.details()
    decode_all(server.stub, "x")


def test_abort_ends_the_stream_and_frees_the_slot(server, engine):
    engine.step_delay = 0.02
    prefill(server.stub, "long", [1], max_tokens=50)
    stream = server.stub.Decode(iter([model_worker_pb2.DecodeRequest(request_id="long")]))
    next(stream)
    assert server.stub.Abort(model_worker_pb2.AbortRequest(request_id="long")).found
    last = None
    for last in stream:
        pass
    assert last is None or last.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert wait_idle(server.engine_loop)
    assert not server.stub.Abort(model_worker_pb2.AbortRequest(request_id="long")).found


def test_concurrent_sequences_share_decode_steps(server, engine):
    """Two sequences decoded together take about as many steps as the longer one, not the sum."""
    engine.gate.clear()  # both requests arrive before the engine runs a step
    futures = [server.stub.Prefill.future(model_worker_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=[start], stopping=common_pb2.StoppingParams(max_tokens=10)))
        for rid, start in (("p", 100), ("q", 200))]
    time.sleep(0.2)
    engine.gate.set()
    assert [f.result(5).first_token.token_id for f in futures] == [101, 201]
    results = {}
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, decode_all(server.stub, r)[0]))
               for r in ("p", "q")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {"p": list(range(102, 111)), "q": list(range(202, 211))}
    assert engine.calls["decode"] <= 11, engine.calls  # 9 steps each after the first token, run together


def test_unattached_request_is_aborted_after_timeout(engine):
    s = Server(engine, attach_timeout=0.3)
    try:
        prefill(s.stub, "orphan", [1], max_tokens=40)
        time.sleep(0.6)
        assert wait_idle(s.engine_loop, timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            decode_all(s.stub, "orphan")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        s.close()


def test_not_ready_is_unavailable():
    s = Server(None)
    try:
        with pytest.raises(grpc.RpcError) as err:
            prefill(s.stub, "early", [1])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        s.close()


def test_get_load_reports_running_and_waiting_requests(server, engine):
    """GetLoad (a router's load signal): two slots held and one request waiting while three decode."""
    idle = server.stub.GetLoad(model_worker_pb2.GetLoadRequest())
    assert (idle.num_requests_running, idle.num_requests_waiting, idle.num_slots) == (0, 0, 2)
    pending = []  # the calls must stay referenced: a collected future cancels its RPC
    for rid in ("a", "b", "c"):  # constrained, with no Decode stream: each holds its slot waiting for a mask
        request = model_worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(),
            stopping=common_pb2.StoppingParams(max_tokens=50), constrained=True)
        request.initial_mask.allowed = mask_bytes([7])
        pending.append(server.stub.Prefill.future(request))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        load = server.stub.GetLoad(model_worker_pb2.GetLoadRequest())
        if (load.num_requests_running, load.num_requests_waiting) == (2, 1):
            break
        time.sleep(0.05)
    assert (load.num_requests_running, load.num_requests_waiting) == (2, 1), load
    assert 0 <= load.kv_cache_usage_perc <= 1
    for rid, call in zip(("a", "b", "c"), pending):
        server.stub.Abort(model_worker_pb2.AbortRequest(request_id=rid))
        call.cancel()


def test_get_load_is_unavailable_until_ready():
    s = Server(None)
    try:
        with pytest.raises(grpc.RpcError) as err:
            s.stub.GetLoad(model_worker_pb2.GetLoadRequest())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        s.close()


def wait_quiet(engine, period: float = 0.3, timeout: float = 10) -> dict:
    """The engine's call counts once they have not changed for `period` seconds (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    calls = dict(engine.calls)
    while time.monotonic() < deadline:
        time.sleep(period)
        if dict(engine.calls) == calls:
            break
        calls = dict(engine.calls)
    return calls


def mask_bytes(allowed: list[int], vocab: int = 1000) -> bytes:
    bits = np.zeros(vocab, bool)
    bits[allowed] = True
    return np.packbits(bits, bitorder="little").tobytes()


def test_masks_and_forced_tokens_over_the_decode_stream(server, engine):
    """A constrained sequence samples only within its masks, waits for each, and forced runs are appended."""
    first = server.stub.Prefill(model_worker_pb2.PrefillRequest(
        request_id="k", prompt_token_ids=[10], stopping=common_pb2.StoppingParams(max_tokens=6), constrained=True,
        initial_mask=common_pb2.TokenMask(allowed=mask_bytes([50, 60]))))
    assert first.first_token.token_id == 50  # smallest allowed >= 11
    deadline = time.monotonic() + 10  # on a loaded machine an earlier test's sequence may still be finishing
    while set(server.engine_loop.scheduler.by_id) != {"k"} and time.monotonic() < deadline:
        time.sleep(0.01)
    steps = wait_quiet(engine)  # and a step dispatched for it before it left has finished
    requests = queue.Queue()
    requests.put(model_worker_pb2.DecodeRequest(request_id="k"))
    stream = server.stub.Decode(iter(requests.get, None))
    time.sleep(0.2)
    assert engine.calls == steps, "a constrained sequence must wait for its mask"
    requests.put(model_worker_pb2.DecodeRequest(step=1, mask=common_pb2.TokenMask(allowed=mask_bytes([7]))))
    msg = next(stream)
    assert [t.token_id for t in msg.tokens] == [7]
    steps = dict(engine.calls)
    engine.gate.clear()  # the next step's mask is there when the forced run arrives
    requests.put(model_worker_pb2.DecodeRequest(step=5, mask=common_pb2.TokenMask(allowed=mask_bytes([998]))))
    requests.put(model_worker_pb2.DecodeRequest(step=2, forced=model_worker_pb2.ForcedTokens(token_ids=[300, 301, 302])))
    time.sleep(1.0)  # both reach the engine loop before the gate opens (0.2 s was too short on a loaded machine)
    engine.gate.set()
    got, last = [], None
    for last in stream:
        got += [(t.token_id, t.forced) for t in last.tokens]
    requests.put(None)
    assert got == [(300, True), (301, True), (302, True), (998, False)]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and last.usage.completion_tokens == 6
    # The last sampled token and the 3 forced ones are computed in one step, which also samples token 5. (A decode
    # step for step 2 may already have been dispatched, waiting for a mask, before the forced run arrived; on a
    # loaded machine it can land after the count above was taken. Its result is discarded: at most one.)
    assert engine.calls["compute"] == steps["compute"] + 1
    assert engine.calls["decode"] - steps["decode"] in (0, 1)


def test_n_choices_share_the_prompt(server, engine):
    """A fork copies its parent's slot once the parent's prompt is computed, and computes no prompt chunk."""
    engine.gate.clear()
    parent = server.stub.Prefill.future(model_worker_pb2.PrefillRequest(
        request_id="p0", prompt_token_ids=list(range(100, 110)), stopping=common_pb2.StoppingParams(max_tokens=3)))
    # The parent must reach the engine first: a fork that arrives before its parent computes its own prompt
    # (and the parent then reuses it through the prefix cache), which is correct but not what this test checks.
    assert engine.entered.wait(10), "p0 never reached the engine"
    child = server.stub.Prefill.future(model_worker_pb2.PrefillRequest(
        request_id="p1", prompt_token_ids=list(range(100, 110)), stopping=common_pb2.StoppingParams(max_tokens=3),
        share_prompt_with="p0"))
    deadline = time.monotonic() + 10
    while server.engine_loop._inbox.qsize() == 0:  # p1 queued behind p0's blocked chunk
        assert time.monotonic() < deadline, "p1 never reached the engine loop"
        time.sleep(0.01)
    engine.gate.set()
    assert parent.result(5).first_token.token_id == 110 and child.result(5).first_token.token_id == 110
    assert engine.calls["copy"] == 1
    assert engine.calls["compute"] == 3, "the 10-token prompt is computed once, in chunks of 4"
    assert decode_all(server.stub, "p0")[0] == [111, 112] and decode_all(server.stub, "p1")[0] == [111, 112]


def test_queue_bound_answers_resource_exhausted():
    engine = FakeEngine(FakeEngineConfig(num_slots=1, max_model_len=MAX_LEN, chunk=4, max_waiting=1))
    s = Server(engine)
    try:
        engine.gate.clear()
        futures = []
        for i in range(3):  # in order: q0 holds the slot (blocked in its compute), q1 waits, q2 finds no room
            futures.append(s.stub.Prefill.future(model_worker_pb2.PrefillRequest(
                request_id=f"q{i}", prompt_token_ids=[1, 2], stopping=common_pb2.StoppingParams(max_tokens=2))))
            deadline = time.monotonic() + 10
            while not (engine.entered.is_set() if i == 0 else s.engine_loop._inbox.qsize() == i):
                assert time.monotonic() < deadline, f"q{i} never reached the engine loop"
                time.sleep(0.01)
        engine.gate.set()
        codes = []
        for f in futures:
            try:
                f.result(10)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.append(err.code())
        # One slot, one waiting place: the third request is refused, never silently dropped.
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 1 and codes.count(grpc.StatusCode.OK) == 2
    finally:
        s.close()


def test_info_reports_the_engine_facts(engine):
    """Info carries the engine facts `engine_facts` derives from the configs, over the wire: Gemma 3 270M's
    512-token window and 32768-token context (its Hugging Face config.json), int8 KV, prefix caching, the chunks
    ascending; a model without sliding layers reports window 0, and float KV its dtype."""
    from families.gemma3.worker import GEMMA3_270M
    from model_worker.engine.engine import EngineConfig
    from model_worker.server.service import engine_facts

    ecfg = EngineConfig(num_slots=2, max_model_len=MAX_LEN, prefill_chunks=(32, 8), kv_int8=True)
    s = Server(engine, **engine_facts(GEMMA3_270M, ecfg))
    try:
        info = s.stub.Info(model_worker_pb2.WorkerInfoRequest())
        assert (info.sliding_window, info.prefix_caching, info.max_position_embeddings, info.kv_cache_dtype,
                list(info.prefill_chunks)) == (512, True, 32768, "int8", [8, 32])
        assert info.max_model_len == MAX_LEN < info.max_position_embeddings
    finally:
        s.close()
    global_only = dataclasses.replace(
        GEMMA3_270M, layers=tuple(dataclasses.replace(spec, attention="full") for spec in GEMMA3_270M.layers))
    facts = engine_facts(global_only, dataclasses.replace(ecfg, kv_int8=False))
    assert (facts["sliding_window"], facts["kv_cache_dtype"]) == (0, "float32")


def test_a_prompt_arriving_during_decode_runs_in_mixed_steps():
    """A 10-token prompt (three 4-token chunks) arriving while another request decodes is computed in mixed steps
    (each chunk with the running request's decode step); both streams are exactly right."""
    engine = FakeEngine(FakeEngineConfig(num_slots=2, max_model_len=MAX_LEN, chunk=4), step_delay=0.01)
    s = Server(engine)
    try:
        assert prefill(s.stub, "p", [100], max_tokens=30).first_token.token_id == 101
        results = {}
        runner = threading.Thread(target=lambda: results.__setitem__("p", decode_all(s.stub, "p")[0]))
        runner.start()
        first = prefill(s.stub, "q", list(range(200, 210)), max_tokens=3)
        assert first.first_token.token_id == 210
        assert decode_all(s.stub, "q")[0] == [211, 212]
        runner.join(10)
        assert results["p"] == list(range(102, 131))
        assert engine.calls.get("mixed", 0) >= 2, engine.calls
    finally:
        s.close()


def test_a_failed_step_ends_every_request_as_unavailable_and_stops_the_loop(engine):
    """A step that raises is fatal (its donated KV buffers may be gone): the running and waiting requests end
    UNAVAILABLE (a retry after the restart can succeed), new ones are refused, and on_fatal reports it."""
    s = Server(engine)
    fatal = threading.Event()
    s.engine_loop.on_fatal = lambda exc: fatal.set()
    try:
        engine.step_delay = 0.02
        prefill(s.stub, "running", [1], max_tokens=50)
        stream = s.stub.Decode(iter([model_worker_pb2.DecodeRequest(request_id="running")]))
        next(stream)

        def explode(*args, **kwargs):
            raise RuntimeError("device lost")

        engine.dispatch_decode = explode
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "restarting" in err.value.details()
        assert fatal.wait(5) and isinstance(s.engine_loop.failed, RuntimeError)
        with pytest.raises(grpc.RpcError) as err:
            prefill(s.stub, "later", [1])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        s.close()


def test_a_prediction_drafts_and_its_usage_comes_back():
    """A worker that speculates (FakeEngine with verify steps): the prediction's tokens are verified as drafts,
    the answer is what it is without them, and the last message reports the prediction's accepted and rejected
    tokens; a prediction with an id out of range or longer than the context is INVALID_ARGUMENT."""
    fake = FakeEngine(FakeEngineConfig(num_slots=2, max_model_len=MAX_LEN, chunk=4, max_draft_tokens=3))
    s = Server(fake)
    try:
        s.engine_loop.speculation = "always"
        request = model_worker_pb2.PrefillRequest(
            request_id="p", prompt_token_ids=[10, 11], stopping=common_pb2.StoppingParams(max_tokens=8),
            prediction_token_ids=[12, 13, 14, 15, 16, 17, 0, 0], draft_scope="tenant")
        first = s.stub.Prefill(request)
        tokens, last = decode_all(s.stub, "p")
        assert [first.first_token.token_id, *tokens] == list(range(12, 20))
        assert (last.usage.accepted_prediction_tokens, last.usage.rejected_prediction_tokens) == (6, 2)
        assert fake.calls.get("verify", 0) > 0
        for bad, fragment in (([1000], "prediction token ids"), ([1] * (MAX_LEN + 1), "more than max_model_len")):
            request.request_id, request.prediction_token_ids[:] = "bad", bad
            with pytest.raises(grpc.RpcError) as err:
                s.stub.Prefill(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in err.value.details()
    finally:
        s.close()

"""Chat output splitting (gateway/generation/chat_output.py), the chat plan (gateway/planning/chat_plan.py) and the
constraints a plan builds: thought channels to reasoning_content, tool calls to OpenAI deltas, streamed == merged, the
first argument fragment before the call's closing marker, stop strings on the token path; ThoughtFirst and grammar-ended
tool constraints on the Gemma 4 test vocabulary; plan errors as 400s."""

from __future__ import annotations

import json

import numpy as np
import pytest

from families.gemma3.gateway import PUBLISHED_IDS as GEMMA3_IDS
from families.gemma4.gateway import PUBLISHED_IDS as GEMMA4_IDS
from families.gemma4.gateway import gemma4_tool_grammar
from gateway.backends.model_facts import ModelFacts
from gateway.core.errors import ApiError
from gateway.core.openai_types import ChatCompletionRequest
from gateway.generation.chat_output import ChatSplitter
from gateway.generation.generate import Delta
from gateway.generation.reasoning import ThoughtFirst
from gateway.planning.chat_plan import plan_chat
from gateway.structured.constraints import Constraint
from gateway.structured.grammar_cache import grammar_for_json_schema
from protos import common_pb2
from tests.gemma4_tokenizer import GEMMA4_CONTROL_IDS

CONTROL = {0, 1, 2, 46, 47, 48, 49, 50, 51, 52, 98, 100, 101, 105, 106}
N = 262_144
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 7}},
    "required": ["city"]}}}


class Vocab:
    """A toy vocabulary: the Gemma 4 control ids plus text tokens made on demand (ids from 1000)."""

    def __init__(self):
        self.bytes = [b""] * 2000
        self.next = 1000
        self.ids: dict[str, int] = {}

    def __call__(self, *pieces) -> list[int]:
        out = []
        for p in pieces:
            if isinstance(p, int):
                out.append(p)
                continue
            if p not in self.ids:
                self.ids[p] = self.next
                self.bytes[self.next] = p.encode()
                self.next += 1
            out.append(self.ids[p])
        return out


def deltas(ids: list[int], split: int, finish: str = "stop") -> list[Delta]:
    """ids as generate() Deltas of `split` tokens each; the last carries the finish reason."""
    out = []
    for i in range(0, len(ids), split):
        toks = [common_pb2.GeneratedToken(token_id=t) for t in ids[i:i + split]]
        out.append(Delta(text="", token_ids=ids[i:i + split], logprobs=[0.0] * len(toks), tokens=toks))
    out[-1].finish_reason = finish
    return out


def run(vocab: Vocab, ids: list[int], split: int, **kw) -> tuple[ChatSplitter, list[dict]]:
    published = GEMMA3_IDS if kw.get("tool_format") == "gemma3" else GEMMA4_IDS  # the family's own spellings
    splitter = ChatSplitter(vocab.bytes, CONTROL, family="gemma4", **({"ids": published} | kw))
    sent = []
    for d in deltas(ids, split):
        sent += splitter.feed(d)
    sent += splitter.finish()
    return splitter, sent


def merge(sent: list[dict]) -> dict:
    """What a client gets by concatenating streamed deltas."""
    content = "".join(d.get("content", "") for d in sent)
    reasoning = "".join(d.get("reasoning_content", "") for d in sent)
    calls: list[dict] = []
    for d in sent:
        for c in d.get("tool_calls", []):
            if c["index"] == len(calls):
                calls.append({"id": c["id"], "name": c["function"]["name"], "arguments": ""})
            calls[c["index"]]["arguments"] += c["function"].get("arguments", "")
    return {"content": content, "reasoning": reasoning, "calls": calls}


def test_thought_channel_goes_to_reasoning_content_in_any_chunking():
    v = Vocab()
    ids = v(100, "thought", "\n", "Two plus", " two", 101, "It is", " 4.", 106)
    results = []
    for split in (1, 2, 3, len(ids)):
        splitter, sent = run(v, ids, split, channels=True)
        assert merge(sent)["reasoning"] == splitter.reasoning == "Two plus two"
        assert merge(sent)["content"] == splitter.content == "It is 4."
        assert splitter.message() == {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two plus two"}
        assert not splitter.plain()
        results.append(splitter.message())
    assert all(r == results[0] for r in results)


def test_gemma4_tool_call_deltas_stream_before_the_closing_marker():
    v = Vocab()
    ids = v("Let me check.", 48, "call:get", "_weather{", "city:", 52, "Par", "is \"", "x", 52, ",days:", "3",
            "}", 49, 48, "call:get_weather{city:", 52, "Oslo", 52, "}", 49, 50)
    splitter, sent = run(v, ids, 1, tool_format="gemma4", channels=True, id_prefix="call_x_")
    got = merge(sent)
    assert got["content"] == "Let me check."
    assert [c["name"] for c in got["calls"]] == ["get_weather", "get_weather"]
    assert json.loads(got["calls"][0]["arguments"]) == {"city": 'Paris "x', "days": 3}
    assert json.loads(got["calls"][1]["arguments"]) == {"city": "Oslo"}
    assert got["calls"][0]["id"] == "call_x_0" and got["calls"][1]["id"] == "call_x_1"
    assert splitter.finish_reason("stop") == "tool_calls" and splitter.finish_reason("length") == "length"
    message = splitter.message()
    assert message["content"] == "Let me check."
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [c["arguments"] for c in got["calls"]]
    # Token by token: the first argument fragment leaves before `<tool_call|>` (id 49) is generated.
    splitter = ChatSplitter(v.bytes, CONTROL, tool_format="gemma4", ids=GEMMA4_IDS)
    first_args = None
    for n, d in enumerate(deltas(ids, 1)):
        out = splitter.feed(d)
        if first_args is None and any(c.get("function", {}).get("arguments") for x in out
                                      for c in x.get("tool_calls", [])):
            first_args = n
    assert first_args is not None and first_args < ids.index(49)
    # Merged non-streamed message == chunking-independent.
    for split in (2, 5, len(ids)):
        assert run(v, ids, split, tool_format="gemma4")[0].message()["tool_calls"] == \
            [{**c, "id": c["id"].replace("call_x_", "call_")} for c in message["tool_calls"]]


def test_only_tool_calls_give_null_content():
    v = Vocab()
    splitter, _ = run(v, v(48, "call:get_weather{city:", 52, "Rome", 52, "}", 49, 50), 3, tool_format="gemma4")
    assert splitter.message()["content"] is None and len(splitter.message()["tool_calls"]) == 1


def test_truncated_call_is_reported_as_length():
    v = Vocab()
    splitter, _ = run(v, v(48, "call:get_weather{city:", 52, "Ro"), 2, tool_format="gemma4")
    assert splitter.truncated and splitter.finish_reason("length") == "length" and not splitter.plain()


def test_gemma3_json_calls_and_plain_text():
    v = Vocab()
    splitter, sent = run(v, v('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}', 106), 1,
                      tool_format="gemma3")
    assert merge(sent)["calls"][0]["name"] == "get_weather"
    assert json.loads(splitter.message()["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    splitter, sent = run(v, v("Just text", " here", 106), 1, tool_format="gemma3")
    assert splitter.message() == {"role": "assistant", "content": "Just text here"} and splitter.plain()


def test_stop_strings_cut_content_on_the_token_path():
    v = Vocab()
    splitter, sent = run(v, v("Hello ", "wor", "ld", " STOP", " more"), 1, channels=True, stops=["STOP"])
    assert splitter.content == merge(sent)["content"] == "Hello world "


def test_text_path_passes_generate_text_through():
    splitter = ChatSplitter([b""] * 10, set())
    assert splitter.feed(Delta(text="abc", token_ids=[1], logprobs=[0.0])) == [{"content": "abc"}]
    assert splitter.finish() == [] and splitter.message() == {"role": "assistant", "content": "abc"}


# ----------------------------------------------------------------------------------------- constraints


@pytest.fixture(scope="module")
def g4_lltok(gemma4_lltok):
    return gemma4_lltok  # built as build_tokenizer would (vocabulary N, EOS 1)


def bits(mask: bytes) -> np.ndarray:
    return np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")[:N].astype(bool)


def test_thought_first_then_json(g4_lltok):
    inner = Constraint(g4_lltok, grammar_for_json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                          "required": ["a"]}), N, [1, 106])
    c = ThoughtFirst(inner, N, 100, 101, [1, 106])
    start = bits(c.mask())
    assert start[100] and not start[106] and not start[1]
    assert not start[g4_lltok.tokenize_str("Hello")[0]]  # the answer must be JSON
    c.advance(100)
    thinking = bits(c.mask())
    assert thinking[101] and thinking[g4_lltok.tokenize_str("Hello")[0]] and not thinking[106] and not thinking[100]
    assert c.forced() == []
    for t in g4_lltok.tokenize_str("thought\nhmm"):
        c.advance(t)
    c.advance(101)
    for t in c.forced():
        c.advance(t)
    assert not c.done()
    answer = bits(c.mask())
    assert not answer[101] and not answer[100]


def test_tool_grammar_ends_with_its_own_stop_token(g4_lltok):
    grammar = gemma4_tool_grammar([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, False,
                                  ids=GEMMA4_IDS)
    c = Constraint(g4_lltok, grammar, N, [1, 106, 50], grammar_ends=True)
    m = bits(c.mask())
    assert m[48] and m.sum() == 1  # <|tool_call> only
    prefer = [52, 49, 50] + [g4_lltok.tokenize_str(x)[0] for x in ("}", "3", "x")]
    generated = []
    while not c.done():
        forced = c.forced()
        if forced:
            for t in forced:
                c.advance(t)
            generated += forced
            continue
        allowed = bits(c.mask())
        assert allowed.any(), generated
        pick = next((t for t in prefer if allowed[t]), int(np.flatnonzero(allowed)[0]))
        c.advance(pick)
        generated.append(pick)
        assert len(generated) < 200
    assert generated[0] == 48 and generated[-1] == 50 and 49 in generated
    splitter = ChatSplitter([g4_lltok.decode_bytes([i]) for i in range(N)], CONTROL, tool_format="gemma4",
                            ids=GEMMA4_IDS)
    _, sent = run_with(splitter, generated)
    args = json.loads(merge(sent)["calls"][0]["arguments"])
    assert set(args) <= {"city", "days"} and isinstance(args["city"], str)


def run_with(splitter: ChatSplitter, ids: list[int]):
    sent = []
    for d in deltas(ids, 1):
        sent += splitter.feed(d)
    return splitter, sent + splitter.finish()


# ---------------------------------------------------------------------------------------------- plans


def facts(arch: str) -> ModelFacts:
    spelled = {**GEMMA4_CONTROL_IDS, "<eos>": 1} if arch == "gemma4" else {"<end_of_turn>": 106, "<eos>": 1}
    token_bytes = [b""] * N
    for spelling, tid in spelled.items():
        token_bytes[tid] = spelling.encode()
    return ModelFacts(name="m", max_model_len=512, vocab_size=N, token_bytes=token_bytes, special_ids=CONTROL,
                      bos_id=2, stop_ids=[1, 106], architecture=arch)


def req(**kw) -> ChatCompletionRequest:
    """A request as plan_chat sees it (built without the request model's own checks, so that plan_chat's are
    tested; the model refuses some of these values first, e.g. an unknown reasoning_effort)."""
    return ChatCompletionRequest.model_construct(messages=[{"role": "user", "content": "hi"}], **kw)


def test_plans_per_model_family():
    p = plan_chat(req(tools=[WEATHER], tool_choice="required"), facts("gemma4"))
    assert p.tool_format == "gemma4" and p.grammar_ends and p.stop_ids == [1, 50, 106] and p.channels
    p = plan_chat(req(tools=[WEATHER], tool_choice="none"), facts("gemma4"))
    assert p.grammar is None and p.banned_ids == [48, 49] and p.tool_format is None
    p = plan_chat(req(tools=[WEATHER]), facts("gemma3"))
    assert p.tool_format == "gemma3" and p.stop_ids == [1, 106] and not p.channels and p.grammar
    p = plan_chat(req(reasoning_effort="high"), facts("gemma4"))
    assert p.thinking and p.template_kwargs == {"enable_thinking": True}
    p = plan_chat(req(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}), facts("gemma4"))
    assert not p.thinking
    assert plan_chat(req(), facts("gemma3")).grammar is None


@pytest.mark.parametrize("kw, param, words", [
    (dict(tools=[WEATHER], response_format={"type": "json_object"}), "response_format", "tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "tool_choice"),
    (dict(tool_choice="required"), "tool_choice", "at least one tool"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "number", "multipleOf": 3}}}}}]), "tools", "multipleOf"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools", "name"),
    (dict(reasoning_effort="extreme"), "reasoning_effort", "extreme"),
    (dict(chat_template_kwargs={"enable_thinking": True}), "chat_template_kwargs", "thinking"),
])
def test_plan_errors_are_400s_naming_the_field(kw, param, words):
    with pytest.raises(ApiError) as err:
        plan_chat(req(**kw), facts("gemma3"))
    assert err.value.status == 400 and err.value.param == param and words in err.value.message


def test_a_call_cut_by_a_stop_string_is_not_reported_as_tool_calls():
    v = Vocab()
    splitter, _ = run(v, v(48, "call:get_weather{city:", 52, "Ro"), 1, tool_format="gemma4")
    assert splitter.finish_reason("stop") == "stop"


def test_a_bare_thought_label_at_the_end_is_not_reasoning():
    v = Vocab()
    splitter, sent = run(v, v(100, "thought\n"), 1, channels=True)
    assert splitter.reasoning == "" and merge(sent)["reasoning"] == ""


def test_the_stop_ids_are_combined_once_in_the_chat_plan():
    """The worker's stop ids: the request's, the tool grammar's end tokens, and under a grammar the model's own;
    a constraint ends with the grammar's; a remembered answer drops a final one of them or of the model's."""
    f = facts("gemma3")
    p = plan_chat(req(response_format={"type": "json_object"}, stop_token_ids=[7]), f)
    assert (p.stop_ids, p.grammar_stop_ids, p.end_ids) == ([1, 7, 106], [1, 106], [1, 7, 106])
    p = plan_chat(req(stop_token_ids=[7]), f)
    assert (p.stop_ids, p.grammar_stop_ids, p.end_ids) == ([7], [], [1, 7, 106])
    p = plan_chat(req(tools=[WEATHER]), facts("gemma4"))
    assert (p.stop_ids, p.grammar_stop_ids, p.end_ids) == ([1, 50, 106], [1, 50, 106], [1, 50, 106])
    assert plan_chat(req(), f).stop_ids == []

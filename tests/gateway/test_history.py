"""The answer history (gateway/history.py): answers remembered under their content and tool calls, scoped by
cache_salt, bounded by bytes, and found again when a client sends the answer back (planner.message_to_pb)."""

from __future__ import annotations

import types

from gateway.completions import remember_answer
from gateway.history import AnswerHistory, answer_key
from gateway.openai_types import ChatMessage
from gateway.planner import message_to_pb
from protos import common_pb2


def test_scopes_never_share_answers():
    h = AnswerHistory()
    h.remember("tenant-a", answer_key("Hi!"), [5, 6])
    assert h.lookup("tenant-a", answer_key("Hi!")) == (5, 6)
    assert h.lookup("tenant-b", answer_key("Hi!")) is None and h.lookup("", answer_key("Hi!")) is None
    assert h.lookup("tenant-a", answer_key("Hi")) is None  # exactly the text, nothing else


def test_tool_call_answers_are_keyed_by_their_calls():
    h = AnswerHistory()
    calls = [("get_weather", '{"city": "Paris"}')]
    h.remember("", answer_key(None, calls), [1, 2, 3])
    assert h.lookup("", answer_key(None, calls)) == (1, 2, 3)
    assert h.lookup("", answer_key(None, [("get_weather", '{"city":"Paris"}')])) is None  # arguments verbatim
    assert h.lookup("", answer_key("", calls)) is None  # content "" is not content null


def test_history_is_bounded_by_bytes():
    h = AnswerHistory(budget=50_000)
    for i in range(1000):
        h.remember("", answer_key(f"answer {i} " + "x" * 100), list(range(20)))
    assert 0 < len(h) < 200
    assert h.lookup("", answer_key("answer 999 " + "x" * 100)) is not None  # the most recent stay


class _Backends:
    def __init__(self):
        self.answers = AnswerHistory()
        self.facts = types.SimpleNamespace(stop_ids=[1, 106])

    def ready_facts(self):
        return self.facts


def _route(content, calls=(), reasoning="", truncated=False):
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, (n, a) in enumerate(calls)]
    return types.SimpleNamespace(reasoning=reasoning, truncated=truncated, message=lambda: message)


def _tokens(ids):
    return [common_pb2.GeneratedToken(token_id=t) for t in ids]


def test_remembered_answers_come_back_with_the_message_that_carries_them():
    b = _Backends()
    whole = types.SimpleNamespace(whole=True)
    remember_answer(b, "s", _route("Hello"), whole, _tokens([7, 8, 106]), stop_ids=[])
    remember_answer(b, "s", _route(None, [("f", '{"a": 1}')]), whole, _tokens([9, 10, 50]), stop_ids=[50])
    remember_answer(b, "s", _route("thought", reasoning="..."), whole, _tokens([11]), stop_ids=[])
    remember_answer(b, "s", _route("cut"), types.SimpleNamespace(whole=False), _tokens([12]), stop_ids=[])
    plain = message_to_pb(ChatMessage(role="assistant", content="Hello"), b.answers, "s")
    assert list(plain.generated_token_ids) == [7, 8]  # the final stop token is the template's to render
    call = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}])
    assert list(message_to_pb(call, b.answers, "s").generated_token_ids) == [9, 10]
    assert not message_to_pb(call, b.answers, "other").generated_token_ids
    for text in ("thought", "cut"):
        assert not message_to_pb(ChatMessage(role="assistant", content=text), b.answers, "s").generated_token_ids
    user = message_to_pb(ChatMessage(role="user", content="Hello"), b.answers, "s")
    assert not user.generated_token_ids

"""The answer history (gateway/backends/history.py): answers remembered under their content, tool calls and reasoning,
as the client received them (cut answers too), scoped by cache_salt, bounded by bytes, and found again when a client
sends the answer back (planner.message_to_pb); what can be sent back (planner._check_tool_call_arguments)."""

from __future__ import annotations

import types

import pytest

from gateway.backends.history import AnswerHistory, answer_key
from gateway.core.errors import ApiError
from gateway.core.openai_types import ChatCompletionRequest, ChatMessage
from gateway.generation.choices import remember_answer
from gateway.planning.planner import _check_tool_call_arguments, message_to_pb
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
        # A toy vocabulary: token i spells chr(ord("a") + i % 26), but 150 spells "xy"; 100, 101 (thought
        # channel), 48 (a Gemma 4 call) and the stop ids are control tokens, spelled as Gemma 4 spells them.
        specials = {1: b"<eos>", 48: b"<|tool_call>", 50: b"<|tool_response>", 100: b"<|channel>",
                    101: b"<channel|>", 106: b"<turn|>"}
        self.facts = types.SimpleNamespace(stop_ids=[1, 106], special_ids=set(specials), architecture="gemma4",
                                           token_bytes=[specials.get(i, bytes([97 + i % 26])) for i in range(200)])
        self.facts.token_bytes[150] = b"xy"

    def ready_facts(self):
        return self.facts


def _route(content, calls=(), reasoning="", truncated=False):
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, (n, a) in enumerate(calls)]
    return types.SimpleNamespace(reasoning=reasoning, truncated=truncated, message=lambda: message)


def _tokens(ids):
    return [common_pb2.GeneratedToken(token_id=t) for t in ids]


def test_remembered_answers_come_back_with_the_message_that_carries_them():
    b = _Backends()
    whole = types.SimpleNamespace(whole=True)
    remember_answer(b, "s", _route("Hello"), whole, _tokens([7, 8, 106]), end_ids=[1, 106])
    remember_answer(b, "s", _route(None, [("f", '{"a": 1}')]), whole, _tokens([9, 10, 50]), end_ids=[1, 50, 106])
    remember_answer(b, "s", _route("tho", reasoning="..."), whole, _tokens([100, 11, 101, 19, 7, 14]), end_ids=[1, 106])
    plain = message_to_pb(ChatMessage(role="assistant", content="Hello"), b.answers, "s")
    assert list(plain.generated_token_ids) == [7, 8]  # the final stop token is the template's to render
    call = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}])
    assert list(message_to_pb(call, b.answers, "s").generated_token_ids) == [9, 10]
    assert not message_to_pb(call, b.answers, "other").generated_token_ids
    thought = ChatMessage(role="assistant", content="tho", reasoning_content="...")
    assert list(message_to_pb(thought, b.answers, "s").generated_token_ids) == [100, 11, 101, 19, 7, 14]
    # Without its reasoning_content it is another message: the template writes no thought for it.
    assert not message_to_pb(ChatMessage(role="assistant", content="tho"), b.answers, "s").generated_token_ids
    user = message_to_pb(ChatMessage(role="user", content="Hello"), b.answers, "s")
    assert not user.generated_token_ids


def test_answers_cut_short_are_remembered_as_the_client_received_them():
    b = _Backends()
    cut = types.SimpleNamespace(whole=False)
    # A stop string cut "cdeSTOP" to "cd" (tokens 2, 3 spell "cd"): only the ids of the text returned.
    remember_answer(b, "s", _route("cd"), cut, _tokens([2, 3, 4, 5]), end_ids=[1, 106])
    assert b.answers.lookup("s", answer_key("cd")) == (2, 3)
    # The text returned ends inside a token (150 spells "xy"; the stop string began at its "y"): nothing.
    remember_answer(b, "s", _route("ax"), cut, _tokens([0, 150, 4]), end_ids=[1, 106])
    assert b.answers.lookup("s", answer_key("ax")) is None
    # After a thought, the text is what follows its closing control token.
    remember_answer(b, "s", _route("hi", reasoning="x"), cut, _tokens([100, 23, 101, 7, 8, 9]), end_ids=[1, 106])
    assert b.answers.lookup("s", answer_key("hi", reasoning="x")) == (100, 23, 101, 7, 8)
    # max_tokens cut a call inside its arguments: every id, the call as returned is the key.
    length = types.SimpleNamespace(whole=True)
    calls = [("f", '{"a": 1}'), ("g", '{"b": "x')]
    remember_answer(b, "s", _route(None, calls, truncated=True), length, _tokens([48, 5, 48, 6, 7]), end_ids=[1, 106])
    assert b.answers.lookup("s", answer_key(None, calls)) == (48, 5, 48, 6, 7)
    # ... and cut a Gemma 4 call before its name was complete (not returned): the ids end before that call.
    remember_answer(b, "s", _route(None, calls[:1], truncated=True), length, _tokens([48, 5, 49, 48, 6]),
                    end_ids=[1, 106])
    assert b.answers.lookup("s", answer_key(None, calls[:1])) == (48, 5, 49)


def test_only_an_answers_last_call_may_come_back_cut_off():
    """A cut-off call's arguments (a JSON object prefix) are accepted where an answer can end: its last call.
    Anything else could never have come from the server: a 400 naming the field."""
    def request(*arguments):
        calls = [{"id": f"c{n}", "type": "function", "function": {"name": "f", "arguments": a}}
                 for n, a in enumerate(arguments)]
        return ChatCompletionRequest(messages=[{"role": "user", "content": "a"},
                                               {"role": "assistant", "content": None, "tool_calls": calls}])

    _check_tool_call_arguments(request('{"a": 1}', '{"b": "pa'))
    _check_tool_call_arguments(request('{"a": 1}', ""))
    for arguments, bad in [(('{"b": "pa', '{"a": 1}'), 0), (('{"a": 1}', '{"a": 1}}'), 1), (("[1]",), 0),
                           (('{"a": 1}', '{"b": "\\udc00x'), 1), (('{"a" 1',), 0)]:
        with pytest.raises(ApiError) as err:
            _check_tool_call_arguments(request(*arguments))
        assert err.value.status == 400 and err.value.param == f"messages.1.tool_calls.{bad}.function.arguments"

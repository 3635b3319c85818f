"""The Responses API's rendering (gateway/api/responses/responses_api.py) of an answer's blocks: the documented event
order with consecutive sequence numbers, output items as they grow and finish, a call cut by the limit left
incomplete and never announced done, the final object (status, usage details), and the warning header."""

from __future__ import annotations

import json
import types

from gateway.api.responses.responses_api import _Builder, _Turn
from gateway.api.responses.responses_request import ResponsesRequest
from gateway.generation.answer_blocks import AnswerEnd, BlockSplitter


def _turn(**body) -> _Turn:
    plan = types.SimpleNamespace(model="m", jobs=[types.SimpleNamespace(params=types.SimpleNamespace(max_tokens=9))],
                                 asked_limit=9)
    return _Turn("resp_" + "0" * 32, ResponsesRequest.model_validate({"input": "x", **body}), plan, [], "", 0, [])


def _events(chunks: list[str]) -> list[dict]:
    return [json.loads(c.split("data: ", 1)[1]) for c in chunks]


def _run(deltas: list[dict], incomplete: bool = False):
    builder, splitter = _Builder(_turn()), BlockSplitter()
    events = splitter.feed(deltas) + splitter.close(incomplete=incomplete)
    return builder, _events([c for e in events for c in builder.events(e)])


def test_a_thought_text_and_call_in_the_documented_order():
    builder, events = _run([{"reasoning_content": "hm"}, {"content": "Hi"},
                            {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]},
                            {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}])
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["item"]["status"] == "in_progress" and events[-1]["item"] == {
        "id": events[-1]["item"]["id"], "type": "function_call", "status": "completed", "call_id": "call_1",
        "name": "f", "arguments": '{"a": 1}'}
    end = AnswerEnd("tool_calls", None, prompt_tokens=10, completion_tokens=7, cached_tokens=4, reasoning_tokens=3)
    final = builder.response(end)
    assert final["status"] == "completed" and [o["type"] for o in final["output"]] == ["reasoning", "message",
                                                                                         "function_call"]
    assert final["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4},
                              "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 3},
                              "total_tokens": 17}
    assert final["max_output_tokens"] == 9


def test_a_call_cut_by_the_limit_is_incomplete_and_never_done():
    builder, events = _run([{"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": '{"a'}}]}],
                           incomplete=True)
    assert "response.function_call_arguments.done" not in [e["type"] for e in events]
    assert events[-1]["type"] == "response.output_item.done" and events[-1]["item"]["status"] == "incomplete"
    final = builder.response(AnswerEnd("length", None, 5, 3, 0))
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"

"""The Messages API's rendering (gateway/api/messages/messages_api.py): content blocks from an answer's blocks, stop
reasons, stream deltas, and the Anthropic error shape."""

from __future__ import annotations

from gateway.api.messages.messages_api import _content, _delta, _start_block, _stop_reason
from gateway.core.errors import ApiError, anthropic_body, error_body
from gateway.generation.answer_blocks import AnswerEnd, Block, BlockEvent


def test_blocks_become_content_blocks():
    assert _content(Block("reasoning", 0, "hm")) == {"type": "thinking", "thinking": "hm", "signature": ""}
    assert _content(Block("text", 1, "Hi")) == {"type": "text", "text": "Hi"}
    call = Block("call", 2, '{"city": "Paris"}', call_id="toolu_1", name="get_weather")
    assert _content(call) == {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                              "input": {"city": "Paris"}}
    assert _content(Block("call", 3, '{"city": "Pa', call_id="t", name="f"))["input"] == {}  # cut by max_tokens
    assert _start_block(call) == {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    assert _delta(BlockEvent("delta", call, '{"ci')) == {"type": "input_json_delta", "partial_json": '{"ci'}
    assert _delta(BlockEvent("delta", Block("reasoning", 0), "x")) == {"type": "thinking_delta", "thinking": "x"}


def test_stop_reasons():
    def end(reason, stop=None):
        return AnswerEnd(reason, stop, 1, 1, 0)

    assert [_stop_reason(end("tool_calls")), _stop_reason(end("length")), _stop_reason(end("stop", "END")),
            _stop_reason(end("stop"))] == ["tool_use", "max_tokens", "stop_sequence", "end_turn"]


def test_errors_take_anthropics_shape_on_the_messages_routes_only():
    err = ApiError(429, "busy", code="overloaded")
    assert anthropic_body(err) == {"type": "error", "error": {"type": "rate_limit_error", "message": "busy"}}
    assert error_body(ApiError(503, "down"), "/v1/messages/count_tokens")["error"]["type"] == "overloaded_error"
    assert error_body(err, "/v1/chat/completions")["error"]["code"] == "overloaded"

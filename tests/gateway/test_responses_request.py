"""The Responses API request translated into the chat request (gateway/api/responses/responses_request.py): items to
messages, tools, tool_choice, text.format, limits, and 400s naming the Responses fields."""

from __future__ import annotations

import pytest

from gateway.api.responses.responses_request import ResponsesRequest, chat_request
from gateway.core.errors import ApiError


def _chat(body: dict, history=(), thinking=False):
    warnings: list[str] = []
    chat, conversation = chat_request(ResponsesRequest.model_validate(body), list(history), thinking, warnings)
    return chat, conversation, warnings


def test_a_turn_of_items_becomes_chat_messages():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                             {"type": "input_text", "text": "in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                             "text": "Use the tool."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "9:00"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny at 9."}]}]
    chat, conversation, _ = _chat({"input": items, "instructions": "You are a weather bot."})
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages[0] == {"role": "system", "content": "You are a weather bot.\n\nBe brief."}
    assert messages[1] == {"role": "user", "content": "Weather in Paris?"}
    assert messages[2]["role"] == "assistant" and messages[2]["reasoning_content"] == "Use the tool."
    assert [c["function"]["name"] for c in messages[2]["tool_calls"]] == ["get_weather", "get_time"]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'
    assert [(m["role"], m.get("tool_call_id"), m["content"]) for m in messages[3:5]] == [
        ("tool", "c1", "Sunny"), ("tool", "c2", "9:00")]
    assert messages[5] == {"role": "assistant", "content": "Sunny at 9."}
    assert conversation[0] == {"role": "developer", "content": "Be brief."}  # instructions are not kept


def test_previous_conversation_comes_first_and_fields_map():
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    chat, conversation, warnings = _chat({
        "input": "And?", "max_output_tokens": 9, "temperature": 0, "top_p": 0.5, "user": "u",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True},
                  {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "reasoning": {"effort": "high"}}, history)
    assert [m.content for m in chat.messages] == ["Hi", "Hello", "And?"] and len(conversation) == 3
    assert chat.max_completion_tokens == 9 and chat.temperature == 0 and chat.top_p == 0.5 and chat.user == "u"
    assert chat.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                            "strict": True}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.parallel_tool_calls is False
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "x",
                                                                           "schema": {"type": "object"}}}
    assert chat.reasoning_effort is None  # no thinking mode: ignored, with a warning
    assert any("web_search" in w and "custom" in w for w in warnings)
    assert any("reasoning.effort" in w for w in warnings)
    assert _chat({"input": "x", "reasoning": {"effort": "low"}}, thinking=True)[0].reasoning_effort == "low"
    assert _chat({"input": "x", "text": {"format": {"type": "json_object"}}})[0].response_format == {
        "type": "json_object"}


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "background": True}, "background"),
])
def test_bad_requests_name_the_responses_field(body, param):
    with pytest.raises(ApiError) as err:
        _chat(body)
    assert err.value.status == 400 and err.value.param == param


def test_the_warning_header_is_bounded_printable_ascii():
    from gateway.api.responses.responses_api import WARNING_HEADER, warning_headers

    assert warning_headers([]) == {}
    value = warning_headers(["tools left out: wëb\n" + "x" * 2000])[WARNING_HEADER]
    assert value.isascii() and value.isprintable() and len(value) <= 1000 and "\\xeb" in value


def test_turns_in_a_row_are_joined_and_non_strict_tools_relaxed():
    """Codex's shape: developer messages, then two user messages in a row; a `strict: false` tool keeps its
    enforceable keywords only (a strict one is left to the planner, which refuses it naming the keyword)."""
    odd = {"type": "object", "properties": {"url": {"type": "string", "format": "uri"}}}
    chat, _, warnings = _chat({"instructions": "Agent.", "input": [
        {"role": "developer", "content": "Sandbox."}, {"role": "user", "content": "<env/>"},
        {"role": "user", "content": "List files."}, {"role": "assistant", "content": "Ok"},
        {"role": "developer", "content": "Be quick."}, {"role": "user", "content": "Go"}],
        "tools": [{"type": "function", "name": "f", "parameters": odd, "strict": False},
                  {"type": "function", "name": "g", "parameters": odd}]})
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Agent.\n\nSandbox."), ("user", "<env/>\n\nList files."), ("assistant", "Ok"),
        ("user", "Be quick.\n\nGo")]
    assert chat.tools[0]["function"]["parameters"] == {"type": "object", "properties": {"url": {"type": "string"}}}
    assert chat.tools[1]["function"]["parameters"] == odd
    assert any("'f'" in w and "format" in w for w in warnings)

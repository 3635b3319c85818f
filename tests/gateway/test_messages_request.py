"""The Anthropic Messages request translated into the chat request (gateway/api/messages/messages_request.py): system
blocks (the billing header left out), tool_use / tool_result / thinking blocks, tools, tool_choice, limits,
and 400s naming the Messages fields."""

from __future__ import annotations

import pytest

from gateway.api.messages.messages_request import (
    CallArguments,
    CountTokensRequest,
    MessagesRequest,
    chat_request,
)
from gateway.core.errors import ApiError
from gateway.core.limits import DEFAULT_DROP_SYSTEM_PATTERN


def _chat(body: dict, thinking=False, calls=None):
    warnings: list[str] = []
    model = MessagesRequest if "max_tokens" in body else CountTokensRequest
    chat = chat_request(model.model_validate(body), thinking, (DEFAULT_DROP_SYSTEM_PATTERN,),
                        calls or CallArguments(), "scope", warnings)
    return chat, warnings


def test_a_tool_round_trip_becomes_chat_messages():
    calls = CallArguments()
    calls.remember("scope", "toolu_1", '{"city":"Paris"}')  # as generated, without spaces
    body = {"max_tokens": 5, "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0.14; cc_entrypoint=cli; cch=1f2e3;"},
        {"type": "text", "text": "You are Claude Code."}, {"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {"tz": "CET"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no clock"}]},
                {"type": "text", "text": "Thanks"}]}],
        "stop_sequences": ["END"], "temperature": 0.5, "top_k": 3, "metadata": {"user_id": "session-9"},
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}, "description": "d"},
                  {"type": "web_search_20250305", "name": "web_search"}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    chat, warnings = _chat(body, calls=calls)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages[0] == {"role": "system", "content": "You are Claude Code.\n\nBe brief."}
    assert messages[2]["reasoning_content"] == "Use the tool." and messages[2]["content"] == "Let me check."
    args = [c["function"]["arguments"] for c in messages[2]["tool_calls"]]
    assert args == ['{"city":"Paris"}', '{"tz": "CET"}']  # the generated text where this gateway returned it
    assert [(m["role"], m.get("tool_call_id"), m["content"]) for m in messages[3:]] == [
        ("tool", "toolu_1", "Sunny"), ("tool", "toolu_2", "Error: no clock"), ("user", None, "Thanks")]
    assert chat.max_completion_tokens == 5 and chat.stop == ["END"] and chat.top_k == 3
    assert chat.user == "session-9" and chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                                            "parameters": {"type": "object"}}}]
    assert any("web_search_20250305" in w for w in warnings)


def test_agent_turns_are_merged_and_odd_tool_keywords_relaxed():
    """Claude Code sends system messages inside `messages` and user turns in a row; tools with keywords the
    grammar cannot enforce (`propertyNames`, `format: uri`) lose those keywords (named in a warning) unless
    the tool is strict."""
    odd = {"type": "object", "properties": {"url": {"type": "string", "format": "uri"},
                                            "meta": {"type": "object", "propertyNames": {"pattern": "^a"}}}}
    chat, warnings = _chat({"max_tokens": 4, "system": "Rules.", "messages": [
        {"role": "system", "content": "More rules."}, {"role": "user", "content": "Hi"},
        {"role": "system", "content": [{"type": "text", "text": "<reminder/>"}]},
        {"role": "user", "content": "Go"}, {"role": "assistant", "content": "Ok"}],
        "tools": [{"name": "fetch", "input_schema": odd}]})
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Rules.\n\nMore rules."), ("user", "Hi\n\n<reminder/>\n\nGo"), ("assistant", "Ok")]
    assert chat.tools[0]["function"]["parameters"] == {"type": "object", "properties": {
        "url": {"type": "string"}, "meta": {"type": "object"}}}
    assert any("format at /properties/url" in w and "propertyNames" in w for w in warnings)
    strict, _ = _chat({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                       "tools": [{"name": "fetch", "input_schema": odd, "strict": True}]})
    assert strict.tools[0]["function"]["parameters"] == odd


def test_tool_choice_thinking_and_structured_output_map():
    base = {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    assert _chat({**base, "tool_choice": {"type": "none"}})[0].tool_choice == "none"
    named = _chat({**base, "tool_choice": {"type": "tool", "name": "f"}})[0]
    assert named.tool_choice == {"type": "function", "function": {"name": "f"}}
    on = _chat({**base, "thinking": {"type": "enabled", "budget_tokens": 1024}}, thinking=True)[0]
    assert on.chat_template_kwargs == {"enable_thinking": True}
    off, warnings = _chat({**base, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert off.chat_template_kwargs is None and warnings
    fmt = _chat({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                 "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})[0]
    assert fmt.response_format == {"type": "json_schema", "json_schema": {"name": "output",
                                                                           "schema": {"type": "object"}}}
    assert _chat({"messages": [{"role": "user", "content": "x"}]})[0].max_completion_tokens is None


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                      "input": [1]}]}]}, "messages.0.content.0.input"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image"}]}]}]},
     "messages.0.content.0.content.0"),
    ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]}, "system.0"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "some"}}, "tool_choice.type"),
])
def test_bad_requests_name_the_messages_field(body, param):
    with pytest.raises(ApiError) as err:
        _chat({"max_tokens": 4, **body})
    assert err.value.status == 400 and err.value.param == param

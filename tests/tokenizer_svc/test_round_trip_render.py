"""Every answer the server returns renders back, sent verbatim as the next turn, as the model generated it.

Pipeline per case: generated ids -> the gateway's own `ChatSplitter` (the message a client gets) and
`remember_answer` (the ids the gateway keeps for it) -> that message with (or without) its remembered ids in
the next turn -> the template (built-in Gemma 3 / Gemma 4, and Gemma 4's official Jinja template as a checkpoint
template). The prefix-cache property: the new prompt starts with the previous prompt plus the generated ids.

The answers' text pieces are tokenized one character per token: not how the tokenizer would split them, so only
ids rendered verbatim pass. The converter of cut-off Gemma 4 arguments is checked against the parser it inverts.
"""

from __future__ import annotations

import pathlib
import re
import types

import pytest

from common.json_prefix import close_json_prefix, scan_json_prefix
from families.gemma3.gateway import PUBLISHED_IDS as GEMMA3_IDS
from families.gemma3.gateway import Gemma3ToolCallParser
from families.gemma3.tokenizer import gemma3_tool_calls_text
from families.gemma3.tokenizer import render as render_gemma3
from families.gemma4.gateway import PUBLISHED_IDS as GEMMA4_IDS
from families.gemma4.gateway import Gemma4ToolCallParser
from families.gemma4.tokenizer import gemma4_arguments_prefix
from families.gemma4.tokenizer import render as render_gemma4
from gateway.backends.history import AnswerHistory, answer_key
from gateway.generation.chat_output import ChatSplitter
from gateway.generation.choices import remember_answer
from gateway.generation.generate import Delta
from protos import common_pb2
from tokenizer_svc.chat_template import Message, TemplateError, tokenize_segments
from tokenizer_svc.jinja_template import JinjaTemplate

pytestmark = pytest.mark.slow
TEMPLATE = pathlib.Path(__file__).parent / "data" / "gemma4_chat_template.jinja"
G4_CONTROL = re.compile(r'(<\|tool_call>|<tool_call\|>|<\|"\|>|<\|channel>|<channel\|>|<\|tool_response>|<turn\|>)')
USER = Message("user", "Weather in Paris?")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


# ----------------------------------------------------------------------------------------- JSON prefixes


def _g4_parse(spelled: str) -> list[str]:
    """The arguments the gateway's Gemma 4 parser returns for `spelled` (control tokens spelled out), per call."""
    ids = {"<|tool_call>": 48, "<tool_call|>": 49, '<|"|>': 52}
    parser, args = Gemma4ToolCallParser(ids=GEMMA4_IDS), []
    deltas = []
    for n, piece in enumerate(G4_CONTROL.split(spelled)):
        deltas += parser.feed(ids[piece], piece) if n % 2 else parser.feed(-1, piece) if piece else []
    for d in deltas + parser.finish():
        for call in d.get("tool_calls", []):
            if call["index"] == len(args):
                args.append("")
            args[call["index"]] += call["function"].get("arguments", "")
    return args


def _spelled(segments) -> str:
    return "".join(s.text for s in segments)


G4_CALL = ('<|tool_call>call:f{city:<|"|>Pa"ris\\ <|"|>,days:-12,deep:{a:[true,null,2.5],b:<|"|><|"|>},'
           'k:[<|"|>x<|"|>,[]]}<tool_call|>')


def test_cut_gemma4_arguments_render_back_as_generated():
    """Cut anywhere inside the arguments, the parser's JSON prefix converts back to the Gemma text it came from,
    short only of a key or number the parser still held."""
    body_start = G4_CALL.index("{")
    for cut in range(body_start + 1, len(G4_CALL) - len("<tool_call|>")):
        spelled = G4_CALL[:cut]
        if spelled.endswith(("<", "<|", '<|"', '<|"|')):  # inside a control token's spelling
            continue
        (args,) = _g4_parse(spelled)
        back = "call:f" + _spelled(gemma4_arguments_prefix(args))
        generated = spelled[len("<|tool_call>"):]
        assert generated.startswith(back) and re.fullmatch(r"[\w.\-]*", generated[len(back):]), (spelled, args)


def test_cut_gemma3_arguments_render_back_verbatim():
    answer = ('{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": '
              '{"city": "Pa\\"ris\\u00e9", "n": [1, 2.5, {"x": null}]}}]}')
    start = answer.index('{"city"')
    for cut in range(start + 1, len(answer) - 3):
        parser = Gemma3ToolCallParser(ids=GEMMA3_IDS)
        deltas = parser.feed(-1, answer[:cut]) + parser.finish()
        args = ["", ""]
        for d in deltas:
            for call in d.get("tool_calls", []):
                args[call["index"]] += call["function"].get("arguments", "")
        calls = [("c0", "f", args[0]), ("c1", "g", args[1])]
        # An answer cut after its arguments closed (`...}}` then `]}` cut) returns complete JSON: that call
        # renders whole, the rest of the object as the template writes it.
        rendered = gemma3_tool_calls_text(calls, "m")
        assert rendered == answer[:cut] or scan_json_prefix(args[1])[1], (cut, rendered)


def test_json_prefixes_close_into_the_mapping_they_reached():
    assert close_json_prefix('{"a": "par') == {"a": "par"}
    assert close_json_prefix('{"a": {"b": [1, tr') == {"a": {"b": [1]}}
    assert close_json_prefix('{"a": 1, "ke') == {"a": 1}
    assert close_json_prefix('{"a": "x\\ud83d') == {"a": "x"}  # a surrogate pair cut in half
    assert close_json_prefix('{"a": 12') == {"a": 12}
    for bad in ('[1]', '{"a": 1}}', '{"a" 1', '{"a": 1.e', '{"a":,', '{"a": 1,}', '{"a": "\x01'):
        with pytest.raises(ValueError):
            scan_json_prefix(bad)


# ------------------------------------------------------------------------------------------- the pipeline


def _ids(tok, spelled: str, control: re.Pattern) -> list[int]:
    """Ids of `spelled`: control tokens by id, every other character its own token (a split the tokenizer
    would never choose, so only ids rendered verbatim reproduce it)."""
    out = []
    for n, piece in enumerate(control.split(spelled)):
        if n % 2:
            out.append(tok.token_id(piece))
        else:
            for ch in piece:
                out += tok.encode(ch, parse_special=False)
    return out


def _returned(tok, fmt: str, ids: list[int], stop_ids: list[int], arch: str) -> tuple[Message, list[int]]:
    """What the gateway returns for `ids` (ChatSplitter) as a template Message carrying the ids it remembered
    (`remember_answer`), and those ids."""
    splitter = ChatSplitter(tok.token_bytes, tok.special_ids, tool_format=fmt, channels=arch == "gemma4",
                            ids=GEMMA4_IDS if arch == "gemma4" else GEMMA3_IDS)
    tokens = [common_pb2.GeneratedToken(token_id=t) for t in ids]
    delta = Delta(text="", token_ids=ids, logprobs=[], tokens=tokens, whole=True)
    splitter.feed(delta)
    splitter.finish()
    facts = types.SimpleNamespace(stop_ids=tok.stop_ids, special_ids=tok.special_ids, token_bytes=tok.token_bytes,
                                  architecture=arch)
    backends = types.SimpleNamespace(answers=AnswerHistory(), ready_facts=lambda: facts)
    remember_answer(backends, "s", splitter, delta, tokens, sorted(set(stop_ids) | set(tok.stop_ids)))
    msg = splitter.message()
    calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    remembered = backends.answers.lookup("s", answer_key(msg["content"], [c[1:] for c in calls],
                                                         msg.get("reasoning_content")))
    return Message("assistant", msg["content"], tool_calls=calls, reasoning=msg.get("reasoning_content") or "",
                   generated_ids=tuple(remembered or ())), list(remembered or ())


def _follow(answer: Message) -> list[Message]:
    """The next turn's messages after an answer: a result per call, else a user message."""
    if answer.tool_calls:
        return [Message("tool", "20C", tool_call_id=cid) for cid, _, _ in answer.tool_calls]
    return [Message("user", "And tomorrow?")]


# Gemma 4 answers (spelled with control tokens; the stop token, if any, last). All come back from the splitter
# as messages; "thought" and "cut_call" need the ids to hit the cache (the template writes the thought with a
# label and newline the model did not, and a cut call closed), the others need them for the split.
G4_ANSWERS = {
    "call": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|><|tool_response>',
    "parallel_calls": ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_call>call:'
                       'get_weather{city:<|"|>Lagos<|"|>,days:2}<tool_call|><|tool_response>'),
    "cut_call": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_call>call:get_weather{city:<|"|>La',
    "cut_call_name": '<|tool_call>call:get_weather{days:1}<tool_call|><|tool_call>call:get_wea',
    "text_then_call": 'Let me check. <|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>',
    "thought_then_call": ('<|channel>thinking about Paris<channel|><|tool_call>call:get_weather{'
                          'city:<|"|>Paris<|"|>}<tool_call|><|tool_response>'),
    "text": "It is sunny in Paris.<turn|>",
    "text_cut": "It is sunny in Pa",
}
G4_STOPS = [50, 106, 1]


@pytest.fixture(scope="module", params=["builtin", "jinja"])
def gemma4(request, gemma4_text_tokenizer):
    render = render_gemma4 if request.param == "builtin" else JinjaTemplate.from_file(TEMPLATE, gemma4_text_tokenizer)
    return render, gemma4_text_tokenizer


@pytest.mark.parametrize("shape", sorted(G4_ANSWERS))
def test_gemma4_answers_sent_back_extend_the_previous_prompt(gemma4, shape):
    render, tok = gemma4
    options = {"enable_thinking": True} if "thought" in shape else {}
    prompt, _ = tokenize_segments(render([USER], True, TOOLS, options), tok)
    ids = _ids(tok, G4_ANSWERS[shape], G4_CONTROL)
    answer, kept = _returned(tok, "gemma4", ids, G4_STOPS, "gemma4")
    assert kept, "every shape is remembered"
    following, _ = tokenize_segments(render([USER, answer] + _follow(answer), True, TOOLS, options), tok)
    assert following[:len(prompt) + len(kept)] == prompt + kept
    if shape == "cut_call_name":  # the call whose name was cut was not returned: its ids are not kept
        assert len(kept) < len(ids) and answer.tool_calls[-1][2] == '{"days":1}'


def test_builtin_and_jinja_render_every_answer_alike(gemma4_text_tokenizer):
    tok = gemma4_text_tokenizer
    jinja = JinjaTemplate.from_file(TEMPLATE, tok)
    for shape, spelled in G4_ANSWERS.items():
        answer, _ = _returned(tok, "gemma4", _ids(tok, spelled, G4_CONTROL), G4_STOPS, "gemma4")
        for with_ids in (True, False):
            sent = answer if with_ids else Message(**{**answer.__dict__, "generated_ids": ()})
            conversation = [USER, sent] + _follow(sent)
            built = tokenize_segments(render_gemma4(conversation, True, TOOLS), tok)
            assert built == tokenize_segments(jinja(conversation, True, TOOLS), tok), (shape, with_ids)


def test_cut_call_without_ids_renders_open_as_generated(gemma4):
    """Not remembered (another gateway, evicted): the cut call is written as the model wrote it, left open."""
    render, tok = gemma4
    calls = [("c0", "get_weather", '{"city":"La')]
    for follow in ([Message("tool", "?", tool_call_id="c0")], [Message("user", "go on")]):
        _, text = tokenize_segments(render([USER, Message("assistant", None, tool_calls=calls)] + follow, True,
                                           TOOLS), tok)
        model = text.split("<|turn>model\n")[1]
        assert model.startswith('<|tool_call>call:get_weather{city:<|"|>La<|tool_response>'), model


def test_thought_is_not_written_back_after_a_later_user_turn(gemma4):
    """Gemma 4 writes an earlier turn's thought back only after the last user message; ids holding the thought
    are then not used (they would write it) and the message renders as the template writes it."""
    render, tok = gemma4
    answer, kept = _returned(tok, "gemma4", _ids(tok, "<|channel>hmm<channel|>Sunny.<turn|>", G4_CONTROL), G4_STOPS,
                             "gemma4")
    assert kept and answer.reasoning == "hmm" and answer.content == "Sunny."
    plain = Message("assistant", "Sunny.", reasoning="hmm")
    later = [Message("user", "And tomorrow?")]
    assert tokenize_segments(render([USER, answer] + later, True), tok) == \
        tokenize_segments(render([USER, plain] + later, True), tok)


def test_only_the_last_call_can_be_cut(gemma4):
    render, _ = gemma4
    calls = [("c0", "get_weather", '{"city":"La'), ("c1", "get_weather", "{}")]
    with pytest.raises(TemplateError, match=r"messages\[1\]\.tool_calls\[0\]"):
        render([USER, Message("assistant", None, tool_calls=calls)], True, TOOLS)


def test_a_template_with_another_call_syntax_renders_cut_calls_closed(gemma4_text_tokenizer):
    """A checkpoint template that does not write Gemma 4 calls gets the cut call as the mapping it reached, and
    no ids are spliced into its own rendering."""
    tok = gemma4_text_tokenizer
    source = ("{{ bos_token }}{% for m in messages %}<|turn>{{ m.role }}\n{% for c in m.tool_calls or [] %}"
              "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}\n{% endfor %}{{ m.content or '' }}"
              "<turn|>\n{% endfor %}")
    template = JinjaTemplate.for_tokenizer(source, tok)
    ids = _ids(tok, '<|tool_call>call:get_weather{city:<|"|>La', G4_CONTROL)
    answer, kept = _returned(tok, "gemma4", ids, G4_STOPS, "gemma4")
    _, text = tokenize_segments(template([USER, answer], False), tok)
    assert 'CALL get_weather {"city": "La"}' in text and "\ue000" not in text
    assert not _contains(tokenize_segments(template([USER, answer], False), tok)[0], kept)


# ---------------------------------------------------------------------------------------------- Gemma 3

G3_ANSWERS = {
    "call": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}<end_of_turn>',
    "parallel_calls": ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                       '{"name": "get_weather", "arguments": {"city": "Lagos", "days": 2}}]}<end_of_turn>'),
    "cut_call": ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "get_weather", "arguments": {"city": "La'),
    "text_then_call": 'Sure. {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}<end_of_turn>',
    "text": "It is sunny.<end_of_turn>",
    "text_cut": "It is sun",
}
G3_CONTROL = re.compile(r"(<end_of_turn>)")


@pytest.mark.parametrize("shape", sorted(G3_ANSWERS))
def test_gemma3_answers_sent_back_extend_the_previous_prompt(text_tokenizer, shape):
    tok = text_tokenizer
    prompt, _ = tokenize_segments(render_gemma3([USER], True, TOOLS), tok)
    ids = _ids(tok, G3_ANSWERS[shape], G3_CONTROL)
    answer, kept = _returned(tok, "gemma3", ids, [106, 1], "gemma3")
    assert kept and bool(answer.tool_calls) == ("call" in shape)
    following, _ = tokenize_segments(render_gemma3([USER, answer] + _follow(answer), True, TOOLS), tok)
    assert following[:len(prompt) + len(kept)] == prompt + kept


def test_gemma3_cut_call_without_ids_renders_as_generated(text_tokenizer):
    calls = [("c0", "get_weather", '{"city": "Paris"}'), ("c1", "get_weather", '{"city": "La')]
    _, text = tokenize_segments(render_gemma3([USER, Message("assistant", None, tool_calls=calls)], False, TOOLS),
                                text_tokenizer)
    assert text.endswith(G3_ANSWERS["cut_call"] + "<end_of_turn>\n")


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))

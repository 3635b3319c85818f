"""Gemma 4 thinking is split by token id, identically however the tokens are chunked."""

from __future__ import annotations

from gateway.generation.reasoning import ReasoningSplitter

# id: bytes; 100 = <|channel>, 101 = <channel|>, 106 = <turn|> (control tokens)
VOCAB = {100: b"<|channel>", 101: b"<channel|>", 106: b"<turn|>", 1: b"thought", 2: b"\n", 3: b"Let me think.",
         4: b" 2+2=4.", 5: b"The answer", 6: b" is 4.", 7: b"\xe2\x82", 8: b"\xac"}


def split(ids):
    token_bytes = [VOCAB.get(i, b"") for i in range(107)]
    splitter = ReasoningSplitter(token_bytes, {100, 101, 106}, 100, 101)
    reasoning = content = ""
    for i in ids:
        r, c = splitter.push(i)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    return reasoning + r, content + c


def test_thought_channel_goes_to_reasoning_without_its_label():
    assert split([100, 1, 2, 3, 4, 101, 5, 6, 106]) == ("Let me think. 2+2=4.", "The answer is 4.")


def test_no_channel_is_all_content_and_split_characters_survive():
    assert split([5, 7, 8, 6]) == ("", "The answer€ is 4.")


def test_channel_without_label_keeps_its_text():
    assert split([100, 3, 101, 5]) == ("Let me think.", "The answer")

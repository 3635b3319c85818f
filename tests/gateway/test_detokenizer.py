"""Incremental detokenization and stop strings on a hand-made vocabulary; UTF-8 at every boundary (cuts, a
token-id prompt ending inside a character, logprob token strings, reasoning and tool-argument text) on the
embedded model's real vocabulary and its byte-fallback tokens."""

from __future__ import annotations

import random

import pytest

from gateway.backends.model_facts import ModelFacts
from gateway.generation.detokenizer import IncrementalDetokenizer, StopMatcher, Utf8Decoder
from gateway.generation.generate import GenParams, _AnswerText
from gateway.generation.logprobs import CompletionLogprobs, TokenStrings, chat_content
from gateway.generation.reasoning import ReasoningSplitter
from gateway.generation.tool_parsers import _TokenText
from protos import common_pb2

# Token i's bytes; 0 is a control token. "é" = C3 A9, "😀" = F0 9F 98 80, split across byte tokens.
VOCAB = [b"<eos>", b"Hello", b" wor", b"ld", b"\xc3", b"\xa9", b"\xf0", b"\x9f", b"\x98", b"\x80", b"!", b"\xff"]


def run(ids, skip=True):
    d = IncrementalDetokenizer(VOCAB, {0}, skip)
    pieces = [d.push(i) for i in ids]
    return pieces, "".join(pieces) + d.flush()


def test_never_emits_a_split_character():
    pieces, text = run([1, 4, 5, 6, 7, 8, 9, 10])
    assert text == "Helloé😀!"
    assert "\ufffd" not in text
    assert pieces == ["Hello", "", "é", "", "", "", "😀", "!"]


def test_invalid_bytes_become_replacement_and_a_cut_character_is_dropped():
    pieces, text = run([1, 11, 6, 7])  # a lone 0xFF, then an unfinished 4-byte sequence at the end
    assert text == (b"Hello\xff").decode("utf-8", errors="replace") == "Hello\ufffd"
    assert pieces == ["Hello", "\ufffd", "", ""]
    # A broken sequence in the middle can never become valid: U+FFFD at once, as bytes.decode gives.
    assert run([6, 7, 10])[1] == b"\xf0\x9f!".decode("utf-8", errors="replace") == "\ufffd!"


def test_control_tokens_skipped_or_kept():
    assert run([1, 0])[1] == "Hello"
    assert run([1, 0], skip=False)[1] == "Hello<eos>"


def feed(stops, chunks):
    m = StopMatcher(stops)
    out = "".join(m.push(c) for c in chunks)
    return out + m.flush(), m.stopped


@pytest.mark.parametrize("chunks", [["Hello wor", "ld STOP here"], ["Hello world S", "T", "OP here"],
                                    ["Hello world ST", "OP"]])
def test_stop_string_straddling_chunks_never_leaks(chunks):
    assert feed(["STOP"], chunks) == ("Hello world ", True)


def test_earliest_of_several_stops_wins():
    assert feed(["world", "Hello w"], ["Hello world"]) == ("", True)
    assert feed(["xyz", "wor"], ["Hello ", "world"]) == ("Hello ", True)


def test_no_stop_releases_everything():
    assert feed(["STOP"], ["abc", "ST", "O"]) == ("abcSTO", False)
    assert feed([], ["abc", "def"]) == ("abcdef", False)


def test_random_chunkings_agree_with_str_find():
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abc\n") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 5))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        expected = (text[: min(hits)], True) if hits else (text, False)
        assert feed(stops, chunks) == expected, (text, stops, chunks)



# ----- UTF-8 at every boundary, on the embedded model's vocabulary ---------------------------------------------
EMOJI = "😀".encode()  # F0 9F 98 80
CJK = "語".encode()  # E8 AA 9E


@pytest.fixture(scope="module")
def vocab(text_tokenizer):
    """(facts, byte-token ids): the real vocabulary and the id of each byte-fallback token `<0xNN>`."""
    tok = text_tokenizer
    facts = ModelFacts(name="m", max_model_len=512, vocab_size=tok.vocab_size, token_bytes=tok.token_bytes,
                       special_ids=tok.special_ids, bos_id=tok.bos_id, stop_ids=tok.stop_ids,
                       architecture="gemma3")
    byte_ids = [tok.token_id(f"<0x{b:02X}>") for b in range(256)]
    assert [tok.token_bytes[i] for i in byte_ids] == [bytes([b]) for b in range(256)]
    return facts, byte_ids


def as_bytes(byte_ids, data: bytes) -> list[int]:
    return [byte_ids[b] for b in data]


def detok(facts, prompt=(), skip=True):
    d = IncrementalDetokenizer(facts.token_bytes, facts.special_ids, skip)
    d.prime(prompt)
    return d


def test_real_vocab_cut_inside_a_character_drops_it(vocab, text_tokenizer):
    facts, byte_ids = vocab
    ids = text_tokenizer.encode("Hi ") + as_bytes(byte_ids, EMOJI + CJK[:2])
    d = detok(facts)
    pieces = [d.push(i) for i in ids]
    assert pieces[-6:] == ["", "", "", "😀", "", ""]
    assert "".join(pieces) + d.flush() == "Hi 😀"


def test_prompt_ending_inside_a_character_is_completed_whole(vocab, text_tokenizer):
    facts, byte_ids = vocab
    prompt = [facts.bos_id] + text_tokenizer.encode("Smile ") + as_bytes(byte_ids, EMOJI[:2])
    answer = as_bytes(byte_ids, EMOJI[2:]) + text_tokenizer.encode(" ok")
    d = detok(facts, prompt)
    assert [d.push(i) for i in answer] == ["", "😀", " ok"]
    # Control tokens carry no character bytes: one after the dangling bytes changes nothing.
    d = detok(facts, prompt + [text_tokenizer.token_id("<end_of_turn>")])
    assert "".join(d.push(i) for i in answer) == "😀 ok"


@pytest.mark.parametrize("answer, expected", [
    (b"!", "!"),  # the answer does not continue the character: the prompt's bytes are dropped silently
    (EMOJI[2:3] + b"!", "\ufffd!"),  # it continues, then breaks: its own byte can never be valid
    (EMOJI[2:3], ""),  # cut while still inside the character
    (CJK, "語"),  # a new character
])
def test_prompt_dangling_bytes_never_leak(vocab, text_tokenizer, answer, expected):
    facts, byte_ids = vocab
    d = detok(facts, text_tokenizer.encode("Hi") + as_bytes(byte_ids, EMOJI[:2]))
    assert "".join(d.push(i) for i in as_bytes(byte_ids, answer)) + d.flush() == expected


def test_random_byte_streams_match_an_independent_reference(vocab, text_tokenizer):
    """Streams of units (whole characters as text tokens or byte tokens, invalid bytes), maybe ending inside a
    character: the text is each unit's `bytes.decode(errors="replace")`, without the final cut character."""
    facts, byte_ids = vocab
    rng = random.Random(5)
    chars = ["a", " the", "é", "語", "😀", "\n"]
    invalid = [b"\x80", b"\xff", b"\xed\xa0", b"\xf0\x28", b"\xc0\xaf"]
    for _ in range(300):
        ids, expected = [], ""
        for _ in range(rng.randint(0, 8)):
            if rng.random() < 0.3:
                unit = rng.choice(invalid)
                ids += as_bytes(byte_ids, unit)
                expected += unit.decode("utf-8", errors="replace")
            else:
                ch = rng.choice(chars)
                ids += text_tokenizer.encode(ch) if rng.random() < 0.5 else as_bytes(byte_ids, ch.encode())
                expected += ch
        if rng.random() < 0.5:
            ch = rng.choice(["é", "語", "😀"]).encode()
            ids += as_bytes(byte_ids, ch[: rng.randint(1, len(ch) - 1)])
        d = detok(facts)
        pieces = [d.push(i) for i in ids]
        assert "".join(pieces) + d.flush() == expected, ids
        strings = TokenStrings(facts)
        assert [strings.chosen(i) for i in ids] == pieces


def token(tid, logprob=-1.0, alts=()):
    return common_pb2.GeneratedToken(token_id=tid, logprob=logprob, top_logprobs=[
        common_pb2.TopLogprob(token_id=a, logprob=logprob) for a in alts])


def test_logprob_token_strings_concatenate_to_the_text(vocab, text_tokenizer):
    facts, byte_ids = vocab
    prompt = text_tokenizer.encode("x") + as_bytes(byte_ids, CJK[:1])
    ids = as_bytes(byte_ids, CJK[1:] + EMOJI) + text_tokenizer.encode("ok") + as_bytes(byte_ids, EMOJI[:3])
    tokens = [token(i, alts=[i, byte_ids[0x41]]) for i in ids]
    whole = chat_content(facts, tokens, 2, TokenStrings(facts, prompt))
    assert [e["token"] for e in whole] == ["", "語", "", "", "", "😀", "ok", "", "", ""]
    assert [e["bytes"] for e in whole] == [list(facts.token_bytes[i]) for i in ids]
    # an alternative: the text it would complete in the chosen token's place
    assert [a["token"] for a in whole[0]["top_logprobs"]] == ["", "A"]
    assert [a["token"] for a in whole[1]["top_logprobs"]] == ["語", "\ufffdA"]
    # streamed one token per chunk with the choice's TokenStrings: the same entries
    strings = TokenStrings(facts, prompt)
    assert [e for t in tokens for e in chat_content(facts, [t], 2, strings)] == whole
    # completions: same strings, offsets that follow them after the echoed prompt
    lp = CompletionLogprobs(facts, 1, offset=2, prompt_ids=prompt)
    parts = [lp.chunk(tokens[:4]), lp.chunk(tokens[4:])]
    assert [t for p in parts for t in p["tokens"]] == [e["token"] for e in whole]
    assert [o for p in parts for o in p["text_offset"]] == [2, 2, 3, 3, 3, 3, 4, 6, 6, 6]


def test_stream_primes_from_the_prompt_and_drops_a_cut_tail(vocab, text_tokenizer):
    facts, byte_ids = vocab

    class Backends:
        def ready_facts(self):
            return facts

    prompt = text_tokenizer.encode("Hi") + as_bytes(byte_ids, EMOJI[:2])
    stream = _AnswerText(Backends(), GenParams(sampling=common_pb2.SamplingParams(), max_tokens=16), prompt)
    first = stream.feed([token(i) for i in as_bytes(byte_ids, EMOJI[2:] + CJK[:2])])
    last = stream.close(stream.feed([]), common_pb2.FINISH_REASON_LENGTH, len(prompt))
    assert (first.text, last.text, last.finish_reason, last.whole) == ("😀", "", "length", True)


def test_reasoning_and_tool_text_drop_a_cut_character(vocab):
    facts, byte_ids = vocab
    splitter = ReasoningSplitter(facts.token_bytes, facts.special_ids, 100, 101)
    pieces = [splitter.push(i) for i in [100] + as_bytes(byte_ids, b"thought\n" + EMOJI[:2])]
    assert pieces[-1] == ("", "") and splitter.flush() == ("", "")
    splitter = ReasoningSplitter(facts.token_bytes, facts.special_ids, 100, 101)
    assert [splitter.push(i) for i in as_bytes(byte_ids, CJK + EMOJI[:3])][2:4] == [("", "語"), ("", "")]
    assert splitter.flush() == ("", "")
    text = _TokenText()
    assert [text.chars(bytes([b])) for b in CJK + EMOJI[:1]] + [text.flush()] == ["", "", "語", "", ""]


def test_decoder_peek_leaves_it_unchanged():
    d = Utf8Decoder()
    d.prime(b"x" + EMOJI[:2])
    assert d.peek(EMOJI[2:]) == "😀" and d.peek(b"!") == "!"
    assert d.decode(EMOJI[2:3]) == "" and d.peek(EMOJI[3:]) == "😀"
    assert d.decode(EMOJI[3:] + EMOJI[:1]) == "😀" and d.peek(b"!") == "\ufffd!"

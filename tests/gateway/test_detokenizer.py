"""Incremental detokenization and stop strings, on a hand-made vocabulary (no model needed)."""

from __future__ import annotations

import random

import pytest

from gateway.detokenizer import IncrementalDetokenizer, StopMatcher

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


def test_invalid_bytes_become_replacement_like_bytes_decode():
    _, text = run([1, 11, 6, 7])  # a lone 0xFF, then an unfinished 4-byte sequence at the end
    assert text == (b"Hello\xff\xf0\x9f").decode("utf-8", errors="replace")


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

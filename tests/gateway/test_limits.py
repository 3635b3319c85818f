"""Client JSON checks (gateway/core/limits.py) and the byte-budget LRU (gateway/core/lru.py), against Python's own json
module as the reference where one exists, with generated inputs (hypothesis)."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.errors import ApiError
from gateway.core.limits import MAX_JSON_DEPTH, JsonError, check_field, json_depth, json_field, parse_json
from gateway.core.lru import ENTRY_OVERHEAD, ByteLRU

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)


def _depth(value) -> int:
    """Reference nesting depth of a parsed value (objects and arrays count one level each)."""
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_json_depth_and_parse_agree_with_the_json_module(value):
    text = json.dumps(value)
    assert json_depth(text) == _depth(value)
    assert parse_json(text) == json.loads(text)
    assert parse_json(text.encode("utf-8")) == json.loads(text)


@given(st.integers(1, 3000))
@settings(max_examples=25, deadline=None)
def test_nesting_beyond_the_limit_is_refused_without_recursion(depth):
    text = "[" * depth + "]" * depth
    assert json_depth(text) == depth
    if depth <= MAX_JSON_DEPTH:
        assert _depth(parse_json(text)) == depth
    else:
        with pytest.raises(JsonError, match="nested deeper"):
            parse_json(text)


@pytest.mark.parametrize("text,why", [
    ('{"a": NaN}', "NaN"), ('{"a": -Infinity}', "Infinity"), ('{"a": 1e400}', "out of range"),
    ('{"a": "\\ud800"}', "surrogate"), ('{"\\udfff": 1}', "surrogate"), ('[1, "\\ud83d"]', "surrogate"),
    ("1" * 5000, "out of range"), ('{"a": ', "not valid JSON"), ("[" * 5000, "nested deeper"),
])
def test_refused_json_names_the_reason(text, why):
    with pytest.raises(JsonError, match=why) as err:
        parse_json(text)
    assert err.value.syntax == (why == "not valid JSON")


def test_invalid_utf8_bytes_are_refused():
    with pytest.raises(JsonError, match="not valid UTF-8"):
        parse_json(b'{"a": "\xff"}')
    assert parse_json('{"a": "\\ud83d\\ude00"}'.encode()) == {"a": "\U0001F600"}  # a pair is one character


def test_depth_ignores_brackets_inside_strings():
    assert json_depth('{"a": "[[[[{{{{", "b": ["\\"[["]}') == 2
    assert json_depth('"unterminated [[[') == 0


def test_field_helpers_give_400s_naming_the_field():
    with pytest.raises(ApiError) as e:
        json_field('{"x": NaN}', "chat.tools_json")
    assert e.value.status == 400 and e.value.param == "chat.tools_json"
    assert json_field("", "x") is None
    with pytest.raises(ApiError) as e:
        check_field({"a": "b" * 100}, "response_format", max_bytes=64)
    assert e.value.status == 400 and "too large" in e.value.message
    deep: dict = {}
    node = deep
    for _ in range(MAX_JSON_DEPTH + 1):
        node["p"] = {}
        node = node["p"]
    with pytest.raises(ApiError, match="nested deeper"):
        check_field(deep, "tools")


# ----------------------------------------------------------------------------------------------------- ByteLRU


def test_lru_evicts_least_recently_used_by_bytes():
    lru: ByteLRU[str, str] = ByteLRU(3 * (100 + ENTRY_OVERHEAD), lambda k, v: len(v))
    for key in "abc":
        assert lru.put(key, "x" * 100)
    assert lru.get("a") == "x" * 100  # a is now the most recent
    lru.put("d", "x" * 100)
    assert "b" not in lru and all(k in lru for k in "acd")
    assert lru.nbytes == 3 * (100 + ENTRY_OVERHEAD) and lru.evictions == 1
    lru.put("e", "x" * 250)  # 2.5 entries' worth: two of the old ones go
    assert "e" in lru and lru.nbytes <= lru.budget
    assert not lru.put("huge", "x" * 10_000) and "huge" not in lru  # larger than the budget: not stored


def test_lru_replacing_a_key_recounts_its_bytes():
    lru: ByteLRU[str, str] = ByteLRU(10_000, lambda k, v: len(v))
    lru.put("a", "x" * 1000)
    lru.put("a", "x" * 10)
    assert lru.nbytes == 10 + ENTRY_OVERHEAD and len(lru) == 1


def test_lru_is_consistent_under_threads():
    lru: ByteLRU[int, bytes] = ByteLRU(50 * (64 + ENTRY_OVERHEAD), lambda k, v: len(v))

    def work(offset):
        for i in range(2000):
            lru.put(offset + i % 97, b"x" * 64)
            lru.get(offset + (i * 7) % 97)

    threads = [threading.Thread(target=work, args=(n * 1000,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(lru) == 50 and lru.nbytes == 50 * (64 + ENTRY_OVERHEAD)

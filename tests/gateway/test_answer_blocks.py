"""`BlockSplitter` (gateway/generation/answer_blocks.py): chat deltas regrouped into blocks that open, grow and close
one after another — the shape both the Responses and the Messages API render."""

from __future__ import annotations

from gateway.generation.answer_blocks import BlockSplitter


def _call(index, fragment, call_id=None, name=None):
    call = {"index": index, "function": {"arguments": fragment}}
    if call_id:
        call.update(id=call_id, type="function")
        call["function"]["name"] = name
    return {"tool_calls": [call]}


def test_blocks_open_in_order_and_close_when_the_next_opens():
    s = BlockSplitter()
    events = s.feed([{"reasoning_content": "think"}, {"reasoning_content": "ing"}, {"content": "Hi"},
                     _call(0, "", "call_a", "f"), _call(0, '{"x"'), _call(0, ": 1}"),
                     _call(1, '{}', "call_b", "g")])
    events += s.close()
    kinds = [(e.kind, e.block.kind, e.block.index) for e in events]
    assert kinds == [("start", "reasoning", 0), ("delta", "reasoning", 0), ("delta", "reasoning", 0),
                     ("stop", "reasoning", 0), ("start", "text", 1), ("delta", "text", 1), ("stop", "text", 1),
                     ("start", "call", 2), ("delta", "call", 2), ("delta", "call", 2), ("stop", "call", 2),
                     ("start", "call", 3), ("delta", "call", 3), ("stop", "call", 3)]
    assert [(b.kind, b.text, b.call_id, b.name) for b in s.blocks] == [
        ("reasoning", "thinking", "", ""), ("text", "Hi", "", ""), ("call", '{"x": 1}', "call_a", "f"),
        ("call", "{}", "call_b", "g")]
    joined = "".join(e.text for e in events if e.kind == "delta" and e.block.index == 2)
    assert joined == s.blocks[2].text


def test_empty_deltas_open_nothing_and_close_is_idempotent():
    s = BlockSplitter()
    assert s.feed([{"content": ""}, {"reasoning_content": ""}]) == []
    assert s.close() == [] and s.blocks == []
    s.feed([{"content": "a"}])
    assert len(s.close()) == 1 and s.close() == []

"""TextTokenizer from a checkpoint's tokenizer.json equals the one prepared from the GGUF."""

from __future__ import annotations

import json
import shutil

import pytest

from tokenizer_svc.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow


def test_checkpoint_tokenizer_json_matches_gguf_rebuild(prepared, text_tokenizer, tmp_path):
    shutil.copy(prepared.dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                                "pad_token": "<pad>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    ckpt = TextTokenizer.from_tokenizer_json(tmp_path)
    assert ckpt.source == "tokenizer.json"
    assert (ckpt.bos_id, ckpt.eos_id, ckpt.pad_id) == (2, 1, 0)
    assert ckpt.stop_ids == [1, 106]
    assert ckpt.special_ids == text_tokenizer.special_ids
    assert ckpt.token_bytes == text_tokenizer.token_bytes
    for text in ["Hello <start_of_turn> wörld 🌍  \t x", "def f():\n    return 1"]:
        assert ckpt.encode(text, add_bos=True) == text_tokenizer.encode(text, add_bos=True)
        assert ckpt.encode(text, parse_special=False) == text_tokenizer.encode(text, parse_special=False)


def test_missing_bos_is_a_clear_error(prepared, tmp_path):
    shutil.copy(prepared.dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|no_such_bos|>"}))
    with pytest.raises(ValueError, match="no_such_bos"):
        TextTokenizer.from_tokenizer_json(tmp_path)


def test_long_texts_encode_alike_and_leave_the_gil_free(text_tokenizer):
    """Above LONG_TEXT characters `encode` switches to the GIL-releasing batch call: the ids are the plain call's,
    and a thread of the same process keeps running meanwhile (so the service's event loop answers health checks;
    `encode` holds the GIL for ~0.5 s per 900 KB)."""
    import threading
    import time

    from tokenizer_svc.tokenizer import LONG_TEXT

    text = "The quick brown fox, <start_of_turn> jumps over 🌍 the lazy dog.\n" * 20_000  # 1.3 MB
    assert len(text) > LONG_TEXT
    for parse_special in (True, False):
        raw = (text_tokenizer.tok if parse_special else text_tokenizer.plain).encode(text, add_special_tokens=False)
        assert text_tokenizer.encode(text, parse_special=parse_special) == raw.ids
    gaps, done = [0.0], threading.Event()

    def tick():
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.002)
            now = time.monotonic()
            gaps[0], last = max(gaps[0], now - last), now

    ticker = threading.Thread(target=tick)
    ticker.start()
    t0 = time.monotonic()
    text_tokenizer.encode(text)
    took = time.monotonic() - t0
    done.set()
    ticker.join()
    # Holding the GIL for the whole call leaves one gap as long as the call; released, the gaps are a few ms here but
    # a loaded CI host (other test workers, the tokenizer's own threads) can deschedule the ticker for a good part of
    # a second, so the bound is half the call, not a fixed fraction tuned on an idle host.
    assert gaps[0] < max(0.25, took / 2), (gaps[0], took)

"""A Gemma 4 tokenizer for tests, made from the Gemma 3 vocabulary (no Gemma 4 tokenizer.json is on disk).

Gemma 4 keeps Gemma 3's ids for its control tokens and gives the reserved ones new spellings (docs/formats.md §4.2;
docs/gemma4-architecture.md §9): the Gemma 3 `<unused40>`..`<unused46>`, `<unused92>`, `<unused94>`, `<unused95>`,
`<start_of_turn>`, `<end_of_turn>` (all control tokens) become `<|tool>`..`<|"|>`, `<|think|>`, `<|channel>`,
`<channel|>`, `<|turn>`, `<turn|>`. Renaming those entries (vocab and added_tokens) of a Gemma 3 tokenizer.json
gives a tokenizer with Gemma 4's control tokens at Gemma 4's ids; ordinary text tokenizes as in Gemma 3, which
is what template tests need (the real Gemma 4 vocabulary differs in its ordinary pieces).
"""

from __future__ import annotations

import json
import pathlib

# Gemma 4 control tokens at their Gemma 4 ids (<pad> 0, <eos> 1, <bos> 2 are shared with Gemma 3).
GEMMA4_CONTROL_IDS = {
    "<|tool>": 46,
    "<tool|>": 47,
    "<|tool_call>": 48,
    "<tool_call|>": 49,
    "<|tool_response>": 50,
    "<tool_response|>": 51,
    '<|"|>': 52,
    "<|think|>": 98,
    "<|channel>": 100,
    "<channel|>": 101,
    "<|turn>": 105,
    "<turn|>": 106,
}
GENERATION_EOS_IDS = [1, 106, 50]  # Gemma 4 IT generation_config.json eos_token_id


def write_gemma4_test_tokenizer(out_dir: pathlib.Path, base_tokenizer_json_path: pathlib.Path) -> pathlib.Path:
    """Write tokenizer.json (Gemma 3's with Gemma 4's control-token spellings at ids 46-52, 98, 100, 101, 105,
    106), tokenizer_config.json (bos `<bos>`, eos `<eos>`, pad `<pad>`) and generation_config.json
    (eos_token_id [1, 106, 50]) into `out_dir`, for `TextTokenizer.from_tokenizer_json(out_dir)`.

    Raises:
      TypeError: the base tokenizer.json is not a BPE model with a dict vocabulary.
      ValueError: the base tokenizer is not a Gemma 3 vocabulary with control tokens at those ids, or a Gemma 4
        spelling already exists in it.
    """
    data = json.loads(pathlib.Path(base_tokenizer_json_path).read_text())
    vocab = data["model"]["vocab"]
    if not isinstance(vocab, dict):
        raise TypeError("expected a BPE tokenizer.json with a dict vocabulary")
    name_of = {i: t for t, i in vocab.items()}
    added = {a["id"]: a for a in data["added_tokens"]}
    for spelling, tid in GEMMA4_CONTROL_IDS.items():
        if spelling in vocab:
            raise ValueError(f"{spelling!r} is already in the base vocabulary")
        if tid not in added or not added[tid]["special"]:
            raise ValueError(f"id {tid} ({name_of.get(tid)!r}) is not a control token of the base vocabulary")
        old = name_of[tid]
        del vocab[old]
        vocab[spelling] = tid
        added[tid]["content"] = spelling
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"})
    )
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": GENERATION_EOS_IDS}))
    return out_dir

"""A `tokenizers` tokenizer plus the facts the services need: special ids, stop ids and every token's bytes.

Two encoders share one vocabulary: the normal one parses control-token text (`<bos>`, `<start_of_turn>`) into
control ids, as raw completion prompts expect; the "plain" one (`encode_special_tokens = True`) treats such text
as ordinary characters, which is how chat message content is always tokenized.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import tokenizers


@dataclasses.dataclass
class TextTokenizer:
    """Encode/decode plus vocabulary facts.

    Attributes:
      tok: tokenizer that parses control tokens written in the text.
      plain: same vocabulary, control-token text treated as plain text.
      bos_id, eos_id, pad_id: special ids.
      stop_ids: ids that end a generated turn by default.
      special_ids: control token ids (left out of generated text).
      token_bytes: token_bytes[i] = the bytes token i contributes to text.
      source: "gguf" or "tokenizer.json".
    """

    tok: tokenizers.Tokenizer
    plain: tokenizers.Tokenizer
    bos_id: int
    eos_id: int
    pad_id: int
    stop_ids: list[int]
    special_ids: set[int]
    token_bytes: list[bytes]
    source: str

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return len(self.token_bytes)

    @classmethod
    def from_prepared(cls, directory: pathlib.Path) -> TextTokenizer:
        """Load a tokenizer prepared from a GGUF (tokenizer.json, vocab_meta.json, token_bytes.bin).

        Raises:
          FileNotFoundError: a file is missing (prepare the model first).
        """
        from tokenizer_svc.gguf_tokenizer import load_token_bytes

        meta = json.loads((directory / "vocab_meta.json").read_text())
        tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        plain = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        plain.encode_special_tokens = True
        end_of_turn = tok.token_to_id("<end_of_turn>")
        stop = [meta["eos_id"]] + ([end_of_turn] if end_of_turn is not None else [])
        return cls(
            tok=tok,
            plain=plain,
            bos_id=meta["bos_id"],
            eos_id=meta["eos_id"],
            pad_id=meta["pad_id"],
            stop_ids=stop,
            special_ids=set(meta["special_ids"]),
            token_bytes=load_token_bytes(directory),
            source="gguf",
        )

    def token_id(self, text: str) -> int:
        """Id of a token spelled `text`.

        Raises:
          KeyError: no such token.
        """
        tid = self.tok.token_to_id(text)
        if tid is None:
            raise KeyError(text)
        return tid

    def encode(self, text: str, parse_special: bool = True, add_bos: bool = False) -> list[int]:
        """Text -> ids. With add_bos, BOS is prepended unless the ids already start with it (exactly one BOS)."""
        enc = self.tok if parse_special else self.plain
        ids = enc.encode(text, add_special_tokens=False).ids
        if add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text (invalid UTF-8 becomes U+FFFD).

        Raises:
          ValueError: an id is out of range.
        """
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {self.vocab_size})")
        data = b"".join(
            self.token_bytes[i] for i in ids if not (skip_special_tokens and i in self.special_ids)
        )
        return data.decode("utf-8", errors="replace")

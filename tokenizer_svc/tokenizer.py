"""A `tokenizers` tokenizer plus the facts the services need: special ids, stop ids and every token's bytes.

Two encoders share one vocabulary: the normal one parses control-token text (`<bos>`, `<start_of_turn>`) into
control ids, as raw completion prompts expect; the "plain" one (`encode_special_tokens = True`) treats such text
as ordinary characters, which is how chat message content is always tokenized.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Sequence

import tokenizers

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
#: Characters from which `encode` releases the GIL (encode_batch); below it the plain call is cheaper.
LONG_TEXT = 4096


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
    def from_prepared(cls, directory: pathlib.Path, end_of_turn: Sequence[str]) -> TextTokenizer:
        """Load a tokenizer prepared from a GGUF (tokenizer.json, vocab_meta.json, token_bytes.bin). Stop ids: EOS,
        then the end-of-turn tokens `end_of_turn` (spellings: the family's `TemplateFacts.end_of_turn`).

        Raises:
          FileNotFoundError: a file is missing (prepare the model first).
        """
        from tokenizer_svc.gguf_tokenizer import load_token_bytes

        meta = json.loads((directory / "vocab_meta.json").read_text())
        tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        plain = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        plain.encode_special_tokens = True
        stop = [meta["eos_id"]] + _end_of_turn_ids(tok, end_of_turn)
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

    @classmethod
    def from_tokenizer_json(cls, directory: pathlib.Path, end_of_turn: Sequence[str] = ()) -> TextTokenizer:
        """Load a checkpoint directory's tokenizer.json (SentencePiece-style "▁" vocabulary with byte fallback, as
        every Gemma checkpoint has), taking BOS/EOS/PAD from tokenizer_config.json when present and extra stop ids
        from generation_config.json `eos_token_id` (Gemma 4 IT: 1, 106, 50). Stop ids: EOS, the end-of-turn tokens
        `end_of_turn` (spellings: the family's `TemplateFacts.end_of_turn`), then the generation_config ids.

        Raises:
          FileNotFoundError: no tokenizer.json.
          ValueError: the BOS or EOS token is not in the vocabulary.
        """
        tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        plain = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        plain.encode_special_tokens = True
        special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        size = tok.get_vocab_size(with_added_tokens=True)
        config = _read_json(directory / "tokenizer_config.json")
        ids = {}
        for role, default in (("bos", "<bos>"), ("eos", "<eos>"), ("pad", "<pad>")):
            name = config.get(f"{role}_token", default)
            name = name.get("content", default) if isinstance(name, dict) else name
            ids[role] = tok.token_to_id(name)
            if ids[role] is None and role != "pad":
                raise ValueError(f"{directory}: the {role} token {name!r} is not in tokenizer.json")
        stop = [ids["eos"]] + _end_of_turn_ids(tok, end_of_turn)
        gen = _read_json(directory / "generation_config.json").get("eos_token_id", [])
        stop += [i for i in (gen if isinstance(gen, list) else [gen]) if i not in stop]
        return cls(
            tok=tok,
            plain=plain,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            pad_id=ids["pad"] if ids["pad"] is not None else 0,
            stop_ids=stop,
            special_ids=special,
            token_bytes=[_piece_bytes(tok.id_to_token(i), i in special) for i in range(size)],
            source="tokenizer.json",
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
        """Text -> ids. With add_bos, BOS is prepended unless the ids already start with it (exactly one BOS).

        Long texts go through `encode_batch`, which releases the GIL while it works (`encode` holds it for long
        enough to stall the service; figures: docs/performance.md), so the service's event loop keeps answering
        health checks meanwhile."""
        enc = self.tok if parse_special else self.plain
        if len(text) > LONG_TEXT:
            ids = enc.encode_batch([text], add_special_tokens=False)[0].ids
        else:
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


def _end_of_turn_ids(tok: tokenizers.Tokenizer, spellings: Sequence[str]) -> list[int]:
    """Ids of the family's end-of-turn tokens (`TemplateFacts.end_of_turn`, e.g. Gemma 3's `<end_of_turn>`, Gemma
    4's `<turn|>`: docs/formats.md §4.1, §4.2) present in the vocabulary."""
    found = (tok.token_to_id(name) for name in spellings)
    return [i for i in found if i is not None]


def _read_json(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _piece_bytes(piece: str | None, special: bool) -> bytes:
    """The bytes a vocabulary piece contributes to text: <0xNN> -> that byte, "▁" -> space, control -> spelling."""
    if piece is None:
        return b""
    if special:
        return piece.encode("utf-8")
    match = _BYTE_PIECE.match(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")

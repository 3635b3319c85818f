"""Rebuild Gemma 3's tokenizer from the metadata of a GGUF file.

A Gemma 3 GGUF (``tokenizer.ggml.model = "llama"``, i.e. the SentencePiece family) carries no
``tokenizer.json`` and no merges: only the pieces, their scores and their token types. This module reads
those (:func:`read_gguf_vocab`), rebuilds an exact HF ``tokenizers`` BPE tokenizer from them
(:func:`build_tokenizer`), derives the bytes each id contributes to decoded text (:func:`token_bytes`), and
caches the result on disk (:func:`build_and_cache`, :func:`load_token_bytes`).

Recipe: ``docs/formats.md`` §3.6 and §6 ("Tokenizer rebuild"), which follows transformers'
``integrations/ggml.py`` ``GGUFGemmaConverter`` (in transformers 5.24:
``integrations/gguf/gguf_tokenizer_mapping.py`` ``gemma_tokenizer`` + ``models/gemma/tokenization_gemma.py``)
and is checked against SentencePiece's BPE encoder and llama.cpp's
``llm_tokenizer_spm_session`` (``src/llama-vocab.cpp``): merge the adjacent pair whose concatenation has the
best score (ties: leftmost), fall back to ``<0xNN>`` byte tokens, and match user-defined tokens whole.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

__all__ = [
    "TOKEN_BYTE",
    "TOKEN_CONTROL",
    "TOKEN_NORMAL",
    "TOKEN_UNKNOWN",
    "TOKEN_UNUSED",
    "TOKEN_USER_DEFINED",
    "GGUFVocab",
    "build_and_cache",
    "build_tokenizer",
    "derive_merges",
    "load_architecture",
    "load_token_bytes",
    "read_architecture",
    "read_gguf_vocab",
    "respell",
    "special_ids",
    "token_bytes",
    "write_architecture",
]

# llama.cpp `llama_token_type` values stored in `tokenizer.ggml.token_type` (docs/formats.md §3.6).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SPIECE_UNDERLINE = "\u2581"  # "▁", SentencePiece's escaped space
TOKENIZER_FILE = "tokenizer.json"
VOCAB_META_FILE = "vocab_meta.json"
TOKEN_BYTES_FILE = "token_bytes.bin"
ARCHITECTURE_FILE = "gguf_architecture.json"
ARCHITECTURE_KEY = "general.architecture"
_TOKEN_BYTES_MAGIC = b"GSTB"
_TOKEN_BYTES_VERSION = 1
_KEY = "tokenizer.ggml."


@dataclass(frozen=True, eq=False)
class GGUFVocab:
    """The tokenizer metadata of a SentencePiece-family GGUF, as stored in the file.

    Attributes:
        tokens: the V pieces in id order, spelled as in the file (whitespace runs with real spaces).
        scores: float32 ``[V]``, ``tokenizer.ggml.scores`` (higher merges first; Gemma's normal tokens:
            strictly falling with id; special and user-defined tokens: -1000).
        token_types: int32 ``[V]``, ``tokenizer.ggml.token_type`` (``TOKEN_*`` constants).
        bos_id, eos_id, unk_id, pad_id: special ids from ``tokenizer.ggml.*_token_id`` (-1 if absent).
        add_bos: ``tokenizer.ggml.add_bos_token``; callers (not the tokenizer) prepend BOS when it is set.

    ``eq=False``: numpy fields make field-wise equality ambiguous, so instances compare by identity.
    """

    tokens: list[str]
    scores: np.ndarray
    token_types: np.ndarray
    bos_id: int
    eos_id: int
    unk_id: int
    pad_id: int
    add_bos: bool

    @property
    def size(self) -> int:
        """The vocabulary size V."""
        return len(self.tokens)


def _field_contents(reader, key: str, default=None, required: bool = True):
    """``reader.fields[key].contents()``; raises ValueError for a missing required key."""
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise ValueError(f"GGUF has no {key!r}; not a tokenizer-bearing GGUF")
        return default
    return field.contents()


def read_gguf_vocab(reader) -> GGUFVocab:
    """Read the tokenizer metadata from an open ``gguf.GGUFReader`` (docs/formats.md §3.6).

    Reads ``tokenizer.ggml.{tokens,scores,token_type,bos_token_id,eos_token_id,unknown_token_id,
    padding_token_id,add_bos_token}`` with ``Field.contents()`` (decoding ``Field.parts`` directly was no
    faster). Opening the reader is the slow part (figures: docs/performance.md).

    Raises:
        ValueError: the file is not a SentencePiece-family ("llama") tokenizer, a required key is
            missing, or the token/score/type arrays disagree in length.
    """
    model = _field_contents(reader, _KEY + "model")
    if model != "llama":
        raise ValueError(f"tokenizer.ggml.model is {model!r}; only SentencePiece ('llama') is supported")
    tokens = list(_field_contents(reader, _KEY + "tokens"))
    scores = np.asarray(_field_contents(reader, _KEY + "scores"), dtype=np.float32)
    types = np.asarray(_field_contents(reader, _KEY + "token_type"), dtype=np.int32)
    if not (len(tokens) == len(scores) == len(types)):
        raise ValueError(f"tokens/scores/token_type lengths differ: {len(tokens)}/{len(scores)}/{len(types)}")
    return GGUFVocab(
        tokens=tokens,
        scores=scores,
        token_types=types,
        bos_id=int(_field_contents(reader, _KEY + "bos_token_id", -1, required=False)),
        eos_id=int(_field_contents(reader, _KEY + "eos_token_id", -1, required=False)),
        unk_id=int(_field_contents(reader, _KEY + "unknown_token_id", -1, required=False)),
        pad_id=int(_field_contents(reader, _KEY + "padding_token_id", -1, required=False)),
        add_bos=bool(_field_contents(reader, _KEY + "add_bos_token", True, required=False)),
    )


def _is_space_run(piece: str) -> bool:
    """True for a piece made only of real spaces (Gemma's user-defined whitespace runs)."""
    return bool(piece) and piece.strip(" ") == ""


def respell(piece: str) -> str:
    """The piece as the BPE model sees it: a run of n real spaces becomes ``"▁" * n``.

    Gemma's GGUF stores its 30 whitespace-run tokens with real spaces, but the normalizer turns text spaces
    into ``"▁"`` before lookup (docs/formats.md §6; transformers ``gemma_tokenizer`` does the same).
    """
    return SPIECE_UNDERLINE * len(piece) if _is_space_run(piece) else piece


def derive_merges(pieces: list[str], mergeable: np.ndarray) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary, best first.

    Args:
        pieces: respelled pieces in id order (``[V]``).
        mergeable: bool ``[V]``, the pieces SentencePiece's BPE loop can build and merge: the normal ones.
            Control and byte pieces are outside its piece table, and user-defined pieces are matched whole
            before BPE runs and then frozen, so none of these is ever a merge result or a merge half.

    Every split of a mergeable piece into two mergeable pieces is a merge, ranked by the piece's id
    (Gemma's scores fall strictly with id among normal pieces, so id order = SentencePiece's score order;
    its ties, the same piece reachable at two positions, go leftmost there, which a merge list cannot
    express; measured: the order of splits within one piece changed nothing on 2,991 such border cases
    and 200k random strings). 513,511 merges for Gemma 3.
    """
    index = {p for p, ok in zip(pieces, mergeable.tolist()) if ok}
    merges: list[tuple[str, str]] = []
    for piece, ok in zip(pieces, mergeable.tolist()):
        if not ok or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                merges.append((left, right))
    return merges


def _mergeable_mask(vocab: GGUFVocab) -> np.ndarray:
    """bool ``[V]``: the pieces that take part in BPE merges (normal tokens, see :func:`derive_merges`)."""
    return vocab.token_types == TOKEN_NORMAL


def _added_tokens(vocab: GGUFVocab, pieces: list[str]) -> tuple[list[AddedToken], list[AddedToken]]:
    """(special control tokens, non-special user-defined tokens) to register as added tokens."""
    control, user = [], []
    for tid, (orig, piece) in enumerate(zip(vocab.tokens, pieces)):
        ttype = vocab.token_types[tid]
        if ttype == TOKEN_CONTROL:
            control.append(AddedToken(piece, special=True, normalized=False))
        elif ttype == TOKEN_USER_DEFINED:
            user.append(AddedToken(piece, special=False, normalized=_is_space_run(orig)))
    return control, user


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """Rebuild the SentencePiece tokenizer as an HF ``tokenizers.Tokenizer`` (docs/formats.md §6).

    ``BPE(vocab, merges, byte_fallback=True, fuse_unk=True, unk_token="<unk>")`` over the respelled pieces;
    normalizer ``Replace(" ", "▁")``; pre-tokenizer ``Split(" ", "merged_with_previous")`` (a no-op after the
    normalizer, as in transformers' ``GemmaTokenizer``: SentencePiece does not split on whitespace); decoder
    ``Replace("▁", " ") + ByteFallback + Fuse``; control tokens (type 3) are special added tokens
    (``normalized=False``); user-defined tokens (type 4) are non-special added tokens, the whitespace runs
    respelled ``"▁" * n`` with ``normalized=True``. No post-processor: BOS is **not** added (callers add it).
    Ids equal the GGUF ids. Slow for Gemma 3 (513,511 merges; figures: docs/performance.md): cache with
    :func:`build_and_cache`.

    Raises:
        ValueError: the vocabulary has duplicate pieces after respelling, or its unk piece is not "<unk>".
    """
    pieces = [respell(t) for t in vocab.tokens]
    vocab_map = {piece: tid for tid, piece in enumerate(pieces)}
    if len(vocab_map) != len(pieces):
        raise ValueError("duplicate pieces in the vocabulary (after respelling whitespace runs)")
    unk = pieces[vocab.unk_id] if 0 <= vocab.unk_id < len(pieces) else None
    if unk != "<unk>":
        raise ValueError(f"expected the unk piece to be '<unk>', got {unk!r}")
    merges = derive_merges(pieces, _mergeable_mask(vocab))
    tok = Tokenizer(BPE(vocab=vocab_map, merges=merges, byte_fallback=True, fuse_unk=True, unk_token=unk))
    tok.normalizer = normalizers.Replace(" ", SPIECE_UNDERLINE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    control, user = _added_tokens(vocab, pieces)
    tok.add_special_tokens(control)
    tok.add_tokens(user)
    return tok


def _byte_value(piece: str) -> int | None:
    """The byte of a ``<0xNN>`` piece, else None."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


def token_bytes(vocab: GGUFVocab) -> list[bytes]:
    """For each id (``[V]``), the bytes that token contributes to decoded text.

    Byte tokens (type 6, ``<0xNN>``) give that single byte; normal and user-defined tokens give the piece
    with ``"▁"`` as a space, UTF-8 encoded; control (3), unknown (2) and unused (5) tokens give their
    spelling UTF-8 encoded (callers treat control ids as special, see :func:`special_ids`). Joining the
    entries of an encoding reproduces the UTF-8 of the text (llama.cpp ``token_to_piece`` semantics).

    Raises:
        ValueError: a type-6 token is not spelled ``<0xNN>``.
    """
    out: list[bytes] = []
    for piece, ttype in zip(vocab.tokens, vocab.token_types.tolist()):
        if ttype == TOKEN_BYTE:
            value = _byte_value(piece)
            if value is None:
                raise ValueError(f"byte token {piece!r} is not spelled <0xNN>")
            out.append(bytes((value,)))
        elif ttype in (TOKEN_NORMAL, TOKEN_USER_DEFINED):
            out.append(piece.replace(SPIECE_UNDERLINE, " ").encode("utf-8"))
        else:
            out.append(piece.encode("utf-8"))
    return out


def special_ids(vocab: GGUFVocab) -> list[int]:
    """Ids of the control tokens (token_type 3), ascending; e.g. 0-4, 105, 106 for Gemma 3."""
    return np.flatnonzero(vocab.token_types == TOKEN_CONTROL).tolist()


def _atomic_write(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    """Call ``write(tmp)`` on a temp file next to ``path``, then ``os.replace`` it into place."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = pathlib.Path(tmp_name)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _encode_token_bytes(entries: Iterable[bytes]) -> bytes:
    """``token_bytes.bin``: magic "GSTB", u32 version, u32 count n, u32 offsets ``[n+1]``, then the blob."""
    entries = list(entries)
    lengths = np.fromiter((len(e) for e in entries), dtype=np.uint64, count=len(entries))
    ends = np.cumsum(lengths)
    if len(ends) and ends[-1] > np.iinfo(np.uint32).max:
        raise ValueError("token bytes exceed the u32 offsets of token_bytes.bin")
    offsets = np.zeros(len(entries) + 1, dtype="<u4")
    offsets[1:] = ends
    header = _TOKEN_BYTES_MAGIC + struct.pack("<II", _TOKEN_BYTES_VERSION, len(entries))
    return header + offsets.tobytes() + b"".join(entries)


def load_token_bytes(out_dir: pathlib.Path) -> list[bytes]:
    """Load ``out_dir/token_bytes.bin`` written by :func:`build_and_cache` (``[V]`` bytes entries).

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: the file is truncated or not in the expected format/version.
    """
    data = (pathlib.Path(out_dir) / TOKEN_BYTES_FILE).read_bytes()
    if len(data) < 12 or data[:4] != _TOKEN_BYTES_MAGIC:
        raise ValueError(f"{TOKEN_BYTES_FILE}: bad magic")
    version, count = struct.unpack_from("<II", data, 4)
    if version != _TOKEN_BYTES_VERSION:
        raise ValueError(f"{TOKEN_BYTES_FILE}: unsupported version {version}")
    blob_start = 12 + 4 * (count + 1)
    if len(data) < blob_start:
        raise ValueError(f"{TOKEN_BYTES_FILE}: truncated offsets")
    offsets = np.frombuffer(data, dtype="<u4", count=count + 1, offset=12).tolist()
    if offsets[0] != 0 or blob_start + offsets[-1] != len(data):
        raise ValueError(f"{TOKEN_BYTES_FILE}: blob size does not match the offsets")
    blob = data[blob_start:]
    return [blob[offsets[i] : offsets[i + 1]] for i in range(count)]


def _vocab_meta(vocab: GGUFVocab) -> dict:
    """The JSON-serialisable contents of ``vocab_meta.json``."""
    return {
        "format_version": 1,
        "vocab_size": vocab.size,
        "bos_id": vocab.bos_id,
        "eos_id": vocab.eos_id,
        "unk_id": vocab.unk_id,
        "pad_id": vocab.pad_id,
        "add_bos": vocab.add_bos,
        "special_ids": special_ids(vocab),
        "token_bytes_file": TOKEN_BYTES_FILE,
    }


def build_and_cache(reader, out_dir: pathlib.Path) -> None:
    """Read the vocabulary from an open ``gguf.GGUFReader`` and write the tokenizer cache to ``out_dir``.

    Writes, each atomically (temp file + ``os.replace``), ``tokenizer.json`` (:func:`build_tokenizer`,
    load with ``tokenizers.Tokenizer.from_file``), ``token_bytes.bin`` (:func:`token_bytes`, load with
    :func:`load_token_bytes`), and last ``vocab_meta.json`` (bos/eos/unk/pad ids, add_bos, vocab_size,
    special_ids), so a present ``vocab_meta.json`` means the other two are complete. Creates ``out_dir``.

    Raises:
        ValueError: from :func:`read_gguf_vocab` / :func:`build_tokenizer` for an unsupported vocabulary.
    """
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = read_gguf_vocab(reader)
    tok = build_tokenizer(vocab)
    _atomic_write(out_dir / TOKENIZER_FILE, lambda p: tok.save(str(p)))
    blob = _encode_token_bytes(token_bytes(vocab))
    _atomic_write(out_dir / TOKEN_BYTES_FILE, lambda p: p.write_bytes(blob))
    meta = json.dumps(_vocab_meta(vocab), indent=1)
    _atomic_write(out_dir / VOCAB_META_FILE, lambda p: p.write_text(meta, encoding="utf-8"))


def read_architecture(reader) -> dict[str, str]:
    """``{"general.architecture": ...}`` of an open ``gguf.GGUFReader``: the metadata ``families.from_gguf``
    reads to find the model family.

    Raises:
        ValueError: the GGUF has no ``general.architecture`` string.
    """
    arch = _field_contents(reader, ARCHITECTURE_KEY, required=False)
    if not isinstance(arch, str):
        raise ValueError(f"the GGUF's {ARCHITECTURE_KEY} is {arch!r}, not a name: its model family is unknown")
    return {ARCHITECTURE_KEY: arch}


def write_architecture(meta: dict[str, str], out_dir: pathlib.Path) -> None:
    """Record :func:`read_architecture`'s metadata in ``out_dir/gguf_architecture.json`` (atomically; creates
    ``out_dir``), so the tokenizer service knows a prepared GGUF's model family without opening the GGUF again."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(meta)
    _atomic_write(out_dir / ARCHITECTURE_FILE, lambda p: p.write_text(text, encoding="utf-8"))


def load_architecture(out_dir: pathlib.Path) -> dict[str, str]:
    """The metadata :func:`write_architecture` recorded: ``{"general.architecture": ...}``.

    Raises:
        FileNotFoundError: the file is missing (the part was not prepared).
    """
    return json.loads((pathlib.Path(out_dir) / ARCHITECTURE_FILE).read_text(encoding="utf-8"))

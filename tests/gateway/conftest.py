"""Fixtures of the gateway tests that use the real vocabularies: llguidance tokenizers of the embedded Gemma 3 and of
the Gemma 4 test tokenizer, each with a token id -> bytes view."""

from __future__ import annotations

import llguidance
import pytest

#: The Gemma vocabularies' size (the masks' width).
N_VOCAB = 262144


class TokenBytes:
    """token id -> bytes, looked up when needed (parsers read only the tokens generated)."""

    def __init__(self, tok):
        self.tok = tok

    def __getitem__(self, token: int) -> bytes:
        return self.tok.decode_bytes([token])


@pytest.fixture(scope="module")
def g3(prepared):
    """(llguidance tokenizer, TokenBytes) of the embedded Gemma 3."""
    tok = llguidance.LLTokenizer((prepared.dir / "tokenizer.json").read_text(), n_vocab=N_VOCAB, eos_token=1)
    return tok, TokenBytes(tok)


@pytest.fixture(scope="module")
def g4(gemma4_lltok):
    """(llguidance tokenizer, TokenBytes) of the Gemma 4 test tokenizer."""
    return gemma4_lltok, TokenBytes(gemma4_lltok)

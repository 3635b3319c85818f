"""ConstraintDriver never sends the worker a message for a step at or past max_tokens: the worker ends the Decode
stream there, and a message written after that end fails the whole call (gRPC marks it INTERNAL)."""

from __future__ import annotations

from gateway.generate import ConstraintDriver
from protos import common_pb2


class ForcingConstraint:
    """A grammar that forces token 7 forever (a long forced run at every step)."""

    vocab_size = 16

    def __init__(self):
        self.advanced = []

    def mask(self) -> bytes:
        return bytes([0x80, 0])

    def forced(self) -> list[int]:
        return [7] * 40

    def done(self) -> bool:
        return False

    def finished(self) -> bool:
        return False

    def advance(self, token: int) -> None:
        self.advanced.append(token)


def _steps(messages) -> list[tuple[int, int]]:
    """(first step, last step) each message covers."""
    return [(m.step, m.step + max(len(m.forced.token_ids), 1) - 1) for m in messages]


def test_nothing_is_sent_at_or_past_max_tokens():
    for max_tokens in (2, 5, 13, 30):
        driver = ConstraintDriver(ForcingConstraint(), max_tokens=max_tokens)
        sent = driver.on_tokens([common_pb2.GeneratedToken(token_id=7)])
        assert sent and all(last < max_tokens for _, last in _steps(sent)), (max_tokens, _steps(sent))
        assert len(driver.c.advanced) <= max_tokens
        more = driver.on_tokens([common_pb2.GeneratedToken(token_id=7, forced=True)] * (max_tokens - 1))
        assert all(last < max_tokens for _, last in _steps(more)), (max_tokens, _steps(more))


def test_without_a_limit_the_whole_run_is_sent():
    driver = ConstraintDriver(ForcingConstraint())
    (run, mask) = driver.on_tokens([common_pb2.GeneratedToken(token_id=7)])
    assert list(run.forced.token_ids) == [7] * 40 and mask.step == 41

"""A model of the engine's step time, for latency-target (SLO) admission and chunk sizing (plain Python and numpy).

A step's time is modelled as linear in what it computes (Sarathi-Serve's and DistServe's observation for
batched decoding: a fixed cost per step, plus costs per decode row, per cached token those rows attend to, per
prompt token of the step's chunk, and per drafted token verified):

    t = c0 + c1 * rows + c2 * kv_tokens + c3 * chunk_tokens + c4 * draft_tokens      (seconds)

The coefficients are least-squares fits (non-negative, a small ridge) over the most recent measured steps, refitted
as steps arrive (`observe`), so the model follows the machine it runs on and what else runs there. Until
`MIN_SAMPLES` steps are measured it predicts nothing (`predict` returns None) and admission falls back to
first-come first-served. Each prediction made before its step ran is compared with the measured time: the
relative errors are kept for the prediction-error metric.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

#: Measured steps kept for the fit (the oldest dropped first).
WINDOW = 512
#: Steps measured before the model predicts.
MIN_SAMPLES = 16
#: Refit after this many new steps (a fit is a 5x5 solve over the window: microseconds).
REFIT_EVERY = 8


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one engine step computes.

    Attributes:
      rows: decode rows (sequences producing a token this step).
      kv_tokens: cached tokens those rows attend to, summed over rows.
      chunk_tokens: prompt tokens computed in the step's chunk (0: a decode-only step).
      draft_tokens: drafted tokens verified (speculative decoding).
    """

    rows: int = 0
    kv_tokens: int = 0
    chunk_tokens: int = 0
    draft_tokens: int = 0

    def features(self) -> np.ndarray:
        """[1, rows, kv_tokens, chunk_tokens, draft_tokens] as float64 (shape (5,))."""
        return np.array([1.0, self.rows, self.kv_tokens, self.chunk_tokens, self.draft_tokens])


class StepTimeModel:
    """Step time (seconds) as a linear function of a `StepShape`, fitted online from measured steps."""

    def __init__(self, coefficients: tuple[float, ...] | None = None, window: int = WINDOW):
        """Args: coefficients: fixed (c0..c4) — a scripted model that never refits (tests, a known machine);
        None: learn from `observe`. window: measured steps kept for the fit."""
        self.fixed = coefficients is not None
        self.coef: np.ndarray | None = np.array(coefficients, dtype=np.float64) if self.fixed else None
        self._x: collections.deque[np.ndarray] = collections.deque(maxlen=window)
        self._y: collections.deque[float] = collections.deque(maxlen=window)
        self._since_fit = 0
        self.errors: collections.deque[float] = collections.deque(maxlen=window)

    @property
    def fitted(self) -> bool:
        """Whether the model predicts (fixed, or fitted on enough steps)."""
        return self.coef is not None

    def predict(self, shape: StepShape) -> float | None:
        """Predicted seconds of a step of this shape, or None before the model is fitted."""
        if self.coef is None:
            return None
        return float(max(self.coef @ shape.features(), 0.0))

    def observe(self, shape: StepShape, seconds: float) -> float | None:
        """Record a measured step: its prediction error (when a prediction was possible), then the sample
        (refitting every `REFIT_EVERY` samples once `MIN_SAMPLES` are in). Returns the relative error
        |predicted - measured| / measured, or None."""
        predicted = self.predict(shape)
        error = abs(predicted - seconds) / seconds if predicted is not None and seconds > 0 else None
        if error is not None:
            self.errors.append(error)
        if self.fixed:
            return error
        self._x.append(shape.features())
        self._y.append(seconds)
        self._since_fit += 1
        if len(self._y) >= MIN_SAMPLES and (self.coef is None or self._since_fit >= REFIT_EVERY):
            self.coef = fit(np.array(self._x), np.array(self._y))
            self._since_fit = 0
        return error

    def error_quantile(self, q: float) -> float | None:
        """The q-quantile (0..1) of the relative prediction errors seen so far, or None."""
        return float(np.quantile(np.array(self.errors), q)) if self.errors else None


def fit(x: np.ndarray, y: np.ndarray, ridge: float = 1e-9, rounds: int = 5) -> np.ndarray:
    """Non-negative least squares by active-set elimination: solve the ridge-regularized normal equations,
    zero the negative coefficients and re-solve without them (a cost cannot be negative; a feature that never
    varies in the window gets 0 rather than a wild value).

    Args:
      x: (n, 5) features; y: (n,) seconds.
    Returns:
      (5,) coefficients, c0 >= 0 .. c4 >= 0.
    """
    active = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    for _ in range(rounds):
        xa = x[:, active]
        scale = np.maximum(np.abs(xa).max(axis=0), 1e-12)  # columns on one scale, so one ridge suits all
        xs = xa / scale
        solved = np.linalg.solve(xs.T @ xs + ridge * len(y) * np.eye(xs.shape[1]), xs.T @ y) / scale
        coef[:] = 0.0
        coef[active] = solved
        if (solved >= 0).all():
            break
        active[np.flatnonzero(active)[solved < 0]] = False
        if not active.any():
            break
    return np.maximum(coef, 0.0)

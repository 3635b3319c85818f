"""A model of the engine's step time, for latency-target (SLO) admission and chunk sizing (plain Python and numpy).

A step's time is modelled as linear in what it computes (Sarathi-Serve's and DistServe's observation for
batched decoding): a fixed cost per step, plus costs per forward pass, per row, per cached token the rows attend
to, per prompt token and per cached token the prompt tokens attend to. What a step computes is what the engine
runs, not what the scheduler asked for: the engine pads a decode batch to its batch bucket, a row's attention to
its KV bucket and a chunk to a compiled chunk size, and a step with a chunk and decode rows is one pass or two
(`Engine.step_programs`). So the features are read from the step's programs (`program_features`):

    t = c0 + c1 * passes + c2 * rows + c3 * padded_rows + c4 * padded_rows * kv_bucket
           + c5 * chunk + c6 * chunk * kv_bucket                                              (seconds)

(rows: the real decode rows, whose sampling and bookkeeping cost; a verify step's rows count each drafted
position.) A line through every program still misses some of them by 20-50% (a verify step's rows are not a
decode step's; the mixed program is not a decode plus a chunk), while each program's own time varies by less
than 10% from step to step: so a set of programs measured `CORRECT_AFTER` times gets its own correction, the
weighted mean of measured / linear over its steps, and the line prices the shapes not run yet. The first
model, on the raw shape (`StepShape.features`: rows, cached tokens, chunk tokens, drafts), missed by ~30% at
the 90th percentile (docs/performance.md, "Latency-target admission").

The coefficients are least-squares fits (non-negative, a small ridge) over the most recent measured steps, refitted
as steps arrive (`observe`), so the model follows the machine it runs on and what else runs there; the worker
seeds it at start-up with the warm-up's timed programs (`seed`). Until it has more samples than coefficients
(seeded) or `MIN_SAMPLES` measured steps it predicts nothing (`predict` returns None), and admission falls back
to first-come first-served. Each prediction made before
its step ran is compared with the measured time: the relative errors are kept for the prediction-error metric.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

import numpy as np

from model_worker.serving.engine_api import ProgramKey, StepShape

__all__ = ["MIN_SAMPLES", "StepShape", "StepTimeModel", "fit", "program_features", "shape_of_program"]

#: Measured steps kept for the fit (the oldest dropped first).
WINDOW = 512
#: Steps measured before the model predicts.
MIN_SAMPLES = 16
#: Refit after this many new steps (a fit is a 7x7 solve over the window: microseconds).
REFIT_EVERY = 8
#: Weight of the newest step in a program set's correction (an exponentially weighted mean of measured / linear).
RATIO_WEIGHT = 0.25
#: Steps of a program set measured before its correction applies.
CORRECT_AFTER = 2


def program_features(shape: StepShape, programs: Iterable[ProgramKey]) -> np.ndarray:
    """Features of a step from the forward programs it runs (see the module docstring), float64 shape (7,):
    [1, passes, rows, padded rows, padded rows x KV bucket, chunk, chunk x KV bucket].

    Decode and verify programs count batch x tokens-per-row rows (a verify row's drafted positions are rows of
    the same matrix products); a mixed program counts its decode rows and its chunk; compute its chunk."""
    passes = rows = attended = chunk = chunk_attended = 0
    for key in programs:
        passes += 1
        if key.kind in ("compute", "mixed"):
            chunk += key.chunk  # compute programs are batch 1
            chunk_attended += key.chunk * key.kv_len
        if key.kind == "mixed":
            rows += key.batch
            attended += key.batch * key.kv_len
        elif key.kind in ("decode", "verify"):
            rows += key.batch * key.chunk
            attended += key.batch * key.chunk * key.kv_len
    return np.array([1.0, passes, shape.rows + shape.draft_tokens, rows, attended, chunk, chunk_attended],
                    dtype=np.float64)


def shape_of_program(key: ProgramKey) -> StepShape:
    """A step that runs exactly this forward program (its rows and chunk filling its buckets): how a timed
    program (`Engine.time_programs`) enters the model."""
    rows = key.batch if key.kind in ("decode", "mixed", "verify") else 0
    drafts = key.batch * (key.chunk - 1) if key.kind == "verify" else 0
    chunk = key.chunk if key.kind in ("compute", "mixed") else 0
    return StepShape(rows=rows, kv_tokens=rows * key.kv_len, chunk_tokens=chunk, draft_tokens=drafts,
                     longest=key.kv_len if rows else 0,
                     chunk_end=(key.kv_len if key.kind == "compute" else chunk) if chunk else 0)


class StepTimeModel:
    """Step time (seconds): a linear function of a step's features, fitted online from measured steps, times a
    per-program correction learned from the steps that ran those programs (see the module docstring)."""

    def __init__(self, coefficients: tuple[float, ...] | None = None, window: int = WINDOW,
                 programs: Callable[[StepShape], tuple[ProgramKey, ...]] | None = None):
        """Args: coefficients: fixed, one per feature — a scripted model that never refits nor corrects (tests,
        a known machine); None: learn from `observe`. window: measured steps kept for the fit. programs: the
        forward programs a step runs (the engine's `step_programs`): features from them (`program_features`)
        and a correction per set of programs; None: the raw shape's five features (`StepShape.features`), for an
        engine that pads nothing."""
        self.programs = programs
        self.fixed = coefficients is not None
        self.coef: np.ndarray | None = np.array(coefficients, dtype=np.float64) if self.fixed else None
        self._x: collections.deque[np.ndarray] = collections.deque(maxlen=window)
        self._y: collections.deque[float] = collections.deque(maxlen=window)
        self._since_fit = 0
        self._ratio: dict[tuple[ProgramKey, ...], tuple[float, int]] = {}  # measured / linear: EWMA, count
        self._seed_x: list[np.ndarray] = []  # timed programs (`seed`), part of every fit
        self._seed_y: list[float] = []
        self.errors: collections.deque[float] = collections.deque(maxlen=window)

    @property
    def fitted(self) -> bool:
        """Whether the model predicts (fixed, or fitted on enough steps)."""
        return self.coef is not None

    def predict(self, shape: StepShape) -> float | None:
        """Predicted seconds of a step of this shape, or None before the model is fitted."""
        if self.coef is None:
            return None
        keys = self.programs(shape) if self.programs is not None else ()
        return self._corrected(keys, self._linear(self._features(shape, keys)))

    def _corrected(self, keys: tuple[ProgramKey, ...], linear: float) -> float:
        ratio, count = self._ratio.get(keys, (1.0, 0))
        return linear * ratio if count >= CORRECT_AFTER else linear

    def observe(self, shape: StepShape, seconds: float) -> float | None:
        """Record a measured step: its prediction error (when a prediction was possible), then the sample
        (refitting every `REFIT_EVERY` samples once `MIN_SAMPLES` are in) and its programs' correction. Returns
        the relative error |predicted - measured| / measured, or None."""
        keys = self.programs(shape) if self.programs is not None else ()
        features = self._features(shape, keys)
        linear = self._linear(features) if self.coef is not None else None
        error = None
        if linear is not None and seconds > 0:
            error = abs(self._corrected(keys, linear) - seconds) / seconds
            self.errors.append(error)
        if self.fixed:
            return error
        if linear and keys:
            ratio, count = self._ratio.get(keys, (seconds / linear, 0))
            self._ratio[keys] = ((1 - RATIO_WEIGHT) * ratio + RATIO_WEIGHT * seconds / linear, count + 1)
        self._add(features, seconds)
        return error

    def seed(self, timed: Iterable[tuple[ProgramKey, float]]) -> None:
        """Start from timed programs (`Engine.time_programs`): each one's features are its own (not those of
        a shape mapped back through the buckets: the grid holds programs no step picks, e.g. a chunk in a
        smaller KV bucket), no prediction error is counted, and they stay in every later fit — the programs
        a busy worker never runs alone (a prompt chunk with no decode rows) stay priced. Timed on all-padding
        inputs, their attention reads almost nothing, so they price attention low until real steps come."""
        if self.fixed:
            return
        for key, seconds in timed:
            shape = shape_of_program(key)
            self._seed_x.append(program_features(shape, (key,)) if self.programs is not None else shape.features())
            self._seed_y.append(seconds)
        if self._seed_x and len(self._seed_y) + len(self._y) > len(self._seed_x[0]):  # more samples than coefficients
            self._refit()

    def _refit(self) -> None:
        self.coef = fit(np.array([*self._seed_x, *self._x]), np.array([*self._seed_y, *self._y]))
        self._since_fit = 0

    def _features(self, shape: StepShape, keys: tuple[ProgramKey, ...]) -> np.ndarray:
        return program_features(shape, keys) if self.programs is not None else shape.features()

    def _linear(self, features: np.ndarray) -> float:
        assert self.coef is not None
        return float(max(self.coef @ features, 0.0))

    def _add(self, features: np.ndarray, seconds: float) -> None:
        self._x.append(features)
        self._y.append(seconds)
        self._since_fit += 1
        if len(self._y) + len(self._seed_y) >= MIN_SAMPLES and (self.coef is None or self._since_fit >= REFIT_EVERY):
            self._refit()

    def error_quantile(self, q: float) -> float | None:
        """The q-quantile (0..1) of the relative prediction errors seen so far, or None."""
        return float(np.quantile(np.array(self.errors), q)) if self.errors else None


def fit(x: np.ndarray, y: np.ndarray, ridge: float = 1e-9, rounds: int = 5) -> np.ndarray:
    """Non-negative least squares by active-set elimination: solve the ridge-regularized normal equations,
    zero the negative coefficients and re-solve without them (a cost cannot be negative; a feature that never
    varies in the window gets 0 rather than a wild value).

    Args:
      x: (n, k) features; y: (n,) seconds.
    Returns:
      (k,) coefficients, each >= 0.
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

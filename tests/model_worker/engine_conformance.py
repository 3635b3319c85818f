"""Static conformance of the engines to the engine contract, for the type checker (never imported at run time).

mypy checks that the JAX engine and the test double are both `engine_api.Engine`s: every method with the
Protocol's parameter names, kinds, defaults and types, every size record with its attributes' types. A signature
that drifts from the contract is a type error here (tests/model_worker/test_engine_api.py runs mypy on this file
and shows that it catches drift).
"""

from __future__ import annotations

from model_worker.engine.engine import Engine
from model_worker.serving import engine_api
from tests.fakes import FakeEngine


def real_engine_is_an_engine(engine: Engine) -> engine_api.Engine:
    """The JAX engine, as the contract (a type error if it does not conform)."""
    return engine


def fake_engine_is_an_engine(engine: FakeEngine) -> engine_api.Engine:
    """The test double, as the contract (a type error if it does not conform)."""
    return engine

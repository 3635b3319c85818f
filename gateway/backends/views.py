"""What each room and front door uses of the backends, as narrow views of `Backends` (typing protocols).

`Backends` (clients.py) owns the channels, the worker pool, the model facts, the answer history, admission, the
metrics and the grammar tokenizer: one owner for the gateway's life. A function receives only the view it uses,
as vLLM's `OpenAIServing*` classes receive an engine client and a model registry rather than the server, and
SGLang's `serving_*` modules a tokenizer manager:

  ModelFactsView    `ready_facts()`: the served model's facts (every room reads them; render helpers only them).
  TokenizerView     + the tokenizer service's stub and `call` (gRPC errors -> ApiError): prompts, `/detokenize`.
  AnswerBook        + the answer history: remembering an answer returned, looking one up in a prompt.
  WorkerView        + routing, the pool, the worker stubs, deadlines and metrics: running a generation.
  PlanningView      tokenizer, answers, the grammar tokenizer and routing: everything the planner asks.
  RunningView       workers and answers: running a plan's choices and remembering their answers.
  RequestView       all of the above: what a request's context carries (`Backends.for_request()`).

Both `Backends` and the per-request `RequestBackends` satisfy every view (tests/gateway/test_backend_views.py
checks each view's members on them, and that each function annotated with a view uses no other member).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from gateway.backends.clients import Timeouts
    from gateway.backends.history import AnswerHistory
    from gateway.backends.metrics import GatewayMetrics
    from gateway.backends.model_facts import ModelFacts
    from gateway.backends.workers import WorkerPool
    from protos import model_worker_pb2_grpc, tokenizer_pb2_grpc

T = TypeVar("T")


@runtime_checkable
class ModelFactsView(Protocol):
    """The served model's facts, one snapshot per request on a request's view."""

    def ready_facts(self) -> ModelFacts:
        """The model facts. Raises ApiError 503 while the backends are not ready."""
        ...


@runtime_checkable
class TokenizerView(ModelFactsView, Protocol):
    """The tokenizer service: its stub and an awaited call whose gRPC errors become ApiError."""

    @property
    def tokenizer(self) -> tokenizer_pb2_grpc.TokenizerStub:
        """The tokenizer service's stub."""
        ...

    async def call(self, backend: str, coro: Awaitable[T]) -> T:
        """Await a unary RPC of `backend` (named in errors). Raises the translated ApiError."""
        ...


@runtime_checkable
class AnswerBook(ModelFactsView, Protocol):
    """The answer history (gateway/backends/history.py), with the facts its ids are read against."""

    answers: AnswerHistory


@runtime_checkable
class WorkerView(ModelFactsView, Protocol):
    """The model workers: a route for a request, the pool (reservations, failures), each worker's stub, the call
    deadlines and the gateway's metrics."""

    pool: WorkerPool
    timeouts: Timeouts
    metrics: GatewayMetrics

    def route(self, session_key: str | None, prompt_ids: list[int], salt: str, tiebreak: str) -> str:
        """The worker address for one request. Raises ApiError 503 when no worker serves."""
        ...

    def worker(self, addr: str) -> model_worker_pb2_grpc.ModelWorkerStub:
        """The stub of a routed worker. Raises ApiError 503 when it has left the pool."""
        ...

    async def call(self, backend: str, coro: Awaitable[T]) -> T:
        """Await a unary RPC of `backend` (named in errors). Raises the translated ApiError."""
        ...


@runtime_checkable
class PlanningView(TokenizerView, AnswerBook, Protocol):
    """What the planner asks: prompts (tokenizer), remembered answers, the grammar tokenizer of the constraints,
    and a worker for the request (its route and a reservation in the pool)."""

    pool: WorkerPool

    async def grammar_tokenizer(self) -> Any:
        """The llguidance tokenizer of the served vocabulary. Raises ApiError 503 while not ready."""
        ...

    def route(self, session_key: str | None, prompt_ids: list[int], salt: str, tiebreak: str) -> str:
        """The worker address for one request. Raises ApiError 503 when no worker serves."""
        ...


@runtime_checkable
class RunningView(WorkerView, AnswerBook, Protocol):
    """Running a plan's choices on the workers and remembering their answers (`choice_runner`, `answer_blocks`)."""


@runtime_checkable
class RequestView(PlanningView, RunningView, Protocol):
    """Everything one request uses of the backends: planning, generation and the answer history."""

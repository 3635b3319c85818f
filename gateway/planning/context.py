"""What a front door knows about a request besides its body, as one value the planner receives.

Every door (REST chat and completions, Responses, Messages, `/tokenize`, gRPC `Generate`) learns the same things
before it plans: the backends' view for this request (`Backends.for_request()`: one `ModelFacts` snapshot, so a
worker restarting mid-request cannot show two configurations to one plan), the gateway's limits, the caller's
tenant (its API key's, "" when the API is open: it scopes the answer history), its session headers (which worker
serves a conversation and whether it keeps the KV between turns) and, for gRPC, the worker request id it chose.
Carried as one frozen value instead of five parameters threaded through each door and the planner.
"""

from __future__ import annotations

import dataclasses

from gateway.backends.views import RequestView
from gateway.backends.workers import Session
from gateway.core.limits import Limits


@dataclasses.dataclass(frozen=True)
class RequestContext:
    """One request's context (module docstring).

    Attributes:
      backends: the backends as this request sees them (`Backends.for_request()`; gateway/backends/views.py).
      limits: the gateway's limits.
      tenant: the caller's tenant (gateway/api/auth.py), "" when the API is open.
      session: the request's session headers (`Session.from_headers`; empty when none was sent).
      request_id: the worker request id of choice 0 of the first prompt (None: a new one).
    """

    backends: RequestView
    limits: Limits
    tenant: str = ""
    session: Session = dataclasses.field(default_factory=Session)
    request_id: str | None = None

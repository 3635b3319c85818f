"""Whether the gateway admits new requests, and how many it is serving: the state of a graceful drain.

On SIGTERM the gateway stops admitting (`/v1` requests get an OpenAI-shaped 503 with `Connection: close`, gRPC
`Generate` UNAVAILABLE, `/health` 503 "draining", so a load balancer moves on) and waits until the requests it was
serving have finished, up to its drain timeout; then it cuts those still running (`cut`: each gets an error, a
stream its final SSE error event) and exits.
"""

from __future__ import annotations

import asyncio
import contextlib

from gateway.core.errors import ApiError


class Admission:
    """Admits requests until `drain()`; counts those in progress. Used on the gateway's event loop only."""

    def __init__(self):
        self.draining = False
        self.active = 0
        self._idle: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self.cutting = False

    def admit(self) -> None:
        """Raises:
          ApiError: 503 (code `shutting_down`) while draining."""
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another replica or shortly",
                           code="shutting_down", headers={"Connection": "close", "Retry-After": "1"})

    @contextlib.contextmanager
    def serving(self):
        """Admit one request (`admit`) and count it while the block runs."""
        self.admit()
        self.active += 1
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)
            self.active -= 1
            if self.active == 0 and self._idle is not None:
                self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Stop admitting and wait until no admitted request is left, at most `timeout` seconds. Returns whether
        all finished."""
        self.draining = True
        if self.active == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def cut(self, grace: float = 2.0) -> None:
        """After a drain timed out: cancel the requests still running (each ends with an error: a JSON 503 or a
        final SSE error event, see RequestGuard) and wait up to `grace` seconds for them to unwind."""
        self.cutting = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=grace)

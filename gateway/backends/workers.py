"""The model workers behind one gateway: where they are, whether they serve, how loaded they are, and which one
serves each request.

A gateway is given one or more `--worker-addr` targets (host:port, or unix:PATH: one worker on a unix socket). A
target whose host name resolves to several addresses (a Kubernetes headless Service, a DNS round-robin name) stands
for one worker per address; targets are resolved again every `refresh_s` seconds, so workers join and leave
without a restart. Each worker gets its own channel; every
RPC of one request goes to the worker it was routed to (`route`). Health and load come from each worker's
grpc.health.v1 service and its `GetLoad` RPC, polled by `poll` (the gateway's watch loop calls it about twice a
second). A worker that fails a call with UNAVAILABLE leaves the routing ring at once (`mark_failed`) and rejoins
when its health check passes again. The routing policy itself (session affinity, prefix awareness, bounded load)
is `gateway.backends.worker_choice.Router`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import ipaddress
import logging
import socket
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import uds
from common.network import CHANNEL_OPTIONS, InternalTls, aio_channel
from gateway.backends.worker_choice import Choice, NoWorkerError, Router, block_hashes, rendezvous_order
from gateway.core.errors import ApiError
from protos import model_worker_pb2, model_worker_pb2_grpc

log = logging.getLogger("gemma_serve.gateway")

BLOCK_TOKENS = 32  # prompt tokens per block of the routing prefix index (gateway.backends.worker_choice.block_hashes)
# A worker keeps its sessions and prefixes while it has a free slot, then until its load exceeds (1 + LOAD_SLACK) x
# the mean (`Router`'s epsilon): past its slots, its conversations evict each other's KV anyway.
LOAD_SLACK = 0.25


def split_target(target: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; ("localhost", 0) of a unix socket "unix:PATH" (the name its
    TLS, if any, verifies: a socket has no host).

    Raises:
      ValueError: no port, a port that is not a number in 1-65535, or a unix address without a path.
    """
    if uds.is_unix(target):
        uds.path_of(target)
        return "localhost", 0
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdecimal() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address {target!r} is not host:port")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve_target(target: str) -> dict[str, str]:
    """The workers a target stands for: {address: the host name TLS must verify}.

    An IP literal, or a name that resolves to one address, is one worker addressed by the target itself (its name
    kept for TLS and for logs). A name that resolves to several addresses is one worker per address (IPv4 first:
    a dual-stack name would otherwise count each host twice), each verified against the name.

    Raises:
      ValueError: a malformed target.
      OSError: the name does not resolve.
    """
    host, port = split_target(target)
    if _is_ip(host) or uds.is_unix(target):  # nothing to resolve
        return {target: host}
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
    addrs = v4 or sorted({i[4][0] for i in infos if i[0] == socket.AF_INET6})
    if len(addrs) <= 1:
        return {target: host}
    return {_join(a, port): host for a in addrs}


@dataclasses.dataclass
class Worker:
    """One worker's channel and stubs, and what the last poll saw."""

    addr: str
    channel: grpc.aio.Channel
    stub: model_worker_pb2_grpc.ModelWorkerStub
    health: health_pb2_grpc.HealthStub
    status: str = "UNREACHABLE"  # the last health status name ("SERVING", "NOT_SERVING", "UNREACHABLE")
    programs_compiling: int = 0  # programs it still compiles while serving, at the last poll (GetLoad)
    late_since: float | None = None  # when its health checks began to pass their deadline on a live connection


#: Seconds a connected worker whose health checks pass their deadline keeps its last status before it counts as
#: UNREACHABLE. A worker whose process holds the GIL for seconds (a large compiled program being serialized into
#: the executable cache on a TPU host) answers late but serves; a worker whose process died fails its checks at
#: once (UNAVAILABLE), and one whose connection is not READY gets no grace.
LATE_GRACE_S = 5.0


class WorkerPool:
    """The gateway's workers and its router (one owner: the gateway's event loop)."""

    def __init__(self, targets: list[str], tls: InternalTls | None, interceptors, refresh_s: float = 5.0,
                 router: Router | None = None):
        """Args: targets: `--worker-addr` values ("host:port"); tls: mutual TLS for the links (None: plain);
        interceptors: gRPC client interceptors of every worker channel (the default deadline); refresh_s: seconds
        between DNS resolutions of the targets; router: the routing policy (default: `Router(epsilon=LOAD_SLACK)`).

        Raises:
          ValueError: no target, or a malformed one.
        """
        if not targets:
            raise ValueError("at least one --worker-addr is needed")
        for t in targets:
            split_target(t)
        self.targets, self.tls, self.interceptors, self.refresh_s = list(targets), tls, interceptors, refresh_s
        self.router = router or Router(epsilon=LOAD_SLACK)
        self.workers: dict[str, Worker] = {}
        self._names: dict[str, str] = {}  # address -> host name to verify (TLS)
        self._resolved_at: float | None = None
        self.refused: dict[str, str] = {}  # address -> why it is kept out of the ring (serves another model)

    # ----- membership ---------------------------------------------------------------------------------------------
    async def resolve(self, force: bool = False) -> None:
        """Resolve the targets (at most every `refresh_s` unless `force`) and open or close channels to match; a
        target that does not resolve keeps the workers it had (a DNS hiccup does not empty the ring)."""
        now = asyncio.get_running_loop().time()
        if not force and self._resolved_at is not None and now - self._resolved_at < self.refresh_s:
            return
        self._resolved_at = now
        found: dict[str, str] = {}
        for target in self.targets:
            try:
                found.update(await asyncio.to_thread(resolve_target, target))
            except OSError as err:
                kept = {a: h for a, h in self._names.items() if h == split_target(target)[0]}
                found.update(kept or {target: split_target(target)[0]})
                log.warning("worker address %s does not resolve (%s); keeping %s", target, err, sorted(kept) or target)
        for addr in set(self.workers) - set(found):
            log.info("worker %s left", addr)
            await self.workers.pop(addr).channel.close()
            self.refused.pop(addr, None)
            self._names.pop(addr, None)
        for addr, host in found.items():
            if addr not in self.workers:
                self._names[addr] = host
                self.workers[addr] = self._connect(addr, host)
                if len(found) > 1 or len(self.workers) > 1:
                    log.info("worker %s joined", addr)
        self.router.set_workers(self.workers)
        for addr, w in self.workers.items():
            self.router.set_healthy(addr, w.status == "SERVING" and addr not in self.refused)

    def _connect(self, addr: str, host: str) -> Worker:
        options = list(CHANNEL_OPTIONS)
        if self.tls is not None and not addr.startswith((host, f"[{host}]")):
            options.append(("grpc.ssl_target_name_override", host))  # an address of a name: verify the name
        channel = aio_channel(addr, self.tls, options=tuple(options), interceptors=self.interceptors)
        return Worker(addr, channel, model_worker_pb2_grpc.ModelWorkerStub(channel),
                      health_pb2_grpc.HealthStub(channel))

    # ----- health and load ------------------------------------------------------------------------------------------
    async def poll(self, timeout: float = 2.0) -> dict[str, str]:
        """Resolve when due, then check every worker's health and (when serving) load; update the router.
        Returns {address: status name}."""
        await self.resolve()
        await asyncio.gather(*(self._poll_one(w, timeout) for w in list(self.workers.values())))
        return {addr: w.status for addr, w in self.workers.items()}

    async def _poll_one(self, w: Worker, timeout: float) -> None:
        try:
            reply = await w.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            w.late_since = None
        except grpc.aio.AioRpcError as err:
            if self._late_but_connected(w, err):
                log.debug("worker %s answers its health checks late", w.addr)
                return  # as it was: routed to as before, its load as last polled
            status = "UNREACHABLE"
        if status != w.status:
            log.info("worker %s: %s", w.addr, status)
        w.status = status
        if status == "SERVING":
            try:
                load = await w.stub.GetLoad(model_worker_pb2.GetLoadRequest(), timeout=timeout)
                # The router adds this gateway's in-flight count: what the worker reports beyond it is other
                # gateways' load (its report includes this gateway's requests once they arrived).
                inflight = self.router.inflight(w.addr)
                reported = load.num_requests_waiting + load.num_requests_running
                self.router.set_load(w.addr, float(max(0, reported - inflight)))
                self.router.set_slots(w.addr, load.num_slots)
                self.router.set_headroom(w.addr, load.headroom_rows)
                w.programs_compiling = load.programs_compiling
            except grpc.aio.AioRpcError as err:
                log.debug("GetLoad of %s failed: %s", w.addr, err)
        self.router.set_healthy(w.addr, status == "SERVING" and w.addr not in self.refused)

    @staticmethod
    def _late_but_connected(w: Worker, err: grpc.aio.AioRpcError) -> bool:
        """Whether a failed health check only passed its deadline on a READY connection of a worker that was not
        already UNREACHABLE, within `LATE_GRACE_S` of the first such check (starting that clock if needed)."""
        late = (err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and w.status != "UNREACHABLE"
                and w.channel.get_state() == grpc.ChannelConnectivity.READY)
        if not late:
            w.late_since = None
            return False
        now = time.monotonic()
        w.late_since = w.late_since or now
        return now - w.late_since < LATE_GRACE_S

    def programs_compiling(self) -> int:
        """Programs the serving workers still compile in the background, together, at the last poll (0: every
        worker at full speed)."""
        return sum(w.programs_compiling for w in self.workers.values() if w.status == "SERVING")

    def serving(self) -> list[Worker]:
        """Workers whose last health check said SERVING (refused ones included: for facts and /health)."""
        return [w for w in self.workers.values() if w.status == "SERVING"]

    def refuse(self, addr: str, why: str) -> None:
        """Keep a worker out of the ring (it serves another model than the others); logged once."""
        if self.refused.get(addr) != why:
            log.error("worker %s is not used: %s", addr, why)
        self.refused[addr] = why
        self.router.set_healthy(addr, False)

    def admit(self, addr: str) -> None:
        """Let a refused worker back in (it now serves the gateway's model)."""
        if self.refused.pop(addr, None) is not None:
            log.info("worker %s now serves the gateway's model", addr)

    def mark_failed(self, addr: str) -> None:
        """A call to `addr` failed as unreachable: out of the ring until a health check passes again."""
        w = self.workers.get(addr)
        if w is not None and w.status == "SERVING":
            log.warning("worker %s failed a call; routing around it", addr)
            w.status = "UNREACHABLE"
        self.router.set_healthy(addr, False)

    # ----- routing --------------------------------------------------------------------------------------------------
    def route(self, session_key: str | None, prompt_ids: list[int], salt: str, tiebreak: str) -> Choice:
        """The worker for one request (all of its choices and RPCs), remembered in the prefix index.

        Args:
          session_key: the explicit session (`x-session-id` header, else the request's `user`), or None.
          prompt_ids: the (first) prompt's token ids; salt: its `cache_salt` (blocks never match across salts).
          tiebreak: a key of the conversation (its first messages), for requests that no prefix decides.
        Raises:
          gateway.backends.worker_choice.NoWorkerError: every worker serves another model (`refuse`).
        """
        self._ensure_workers()
        blocks = block_hashes(prompt_ids, BLOCK_TOKENS, salt)
        try:
            choice = self.router.pick(session_key or None, blocks, tiebreak)
        except NoWorkerError:
            # No worker passed its last health check: try the key's worker anyway (its call fails fast, as a 503,
            # if it is really down), unless every worker serves another model.
            usable = [a for a in self.workers if a not in self.refused]
            if not usable:
                raise
            return Choice(rendezvous_order(session_key or tiebreak, usable)[0], "unhealthy")
        self.router.record(choice.addr, blocks, session_key or tiebreak or None)
        return choice

    def reserve(self, addr: str, count: int) -> Reservation:
        """Count `count` generations routed to `addr` as in flight from now (the router's load until the next
        poll, so that a burst spreads), until each is released."""
        return Reservation(self.router, addr, count)

    def _ensure_workers(self) -> None:
        """Before the first resolution (no health poll has run yet): the targets as given, unresolved."""
        if not self.workers and self._resolved_at is None:
            for target in self.targets:
                self._names[target] = split_target(target)[0]
                self.workers[target] = self._connect(target, self._names[target])
            self.router.set_workers(self.workers)

    def stub(self, addr: str) -> model_worker_pb2_grpc.ModelWorkerStub:
        """The stub of a routed worker.

        Raises:
          KeyError: the worker left the pool since the request was routed.
        """
        return self.workers[addr].stub

    async def close(self) -> None:
        """Close every channel."""
        for w in self.workers.values():
            await w.channel.close()


@dataclasses.dataclass(frozen=True)
class Session:
    """A request's session, from its `x-session-*` headers (gRPC: metadata of the same names).

    Attributes:
      key: `x-session-id` (at most 256 characters), or None: the request's `user` field then stands in.
      ttl: `x-session-ttl`, seconds the worker should keep the session's KV after this turn (0: no lease; the
        worker caps it at its --max-session-ttl).
      release: `x-session-release: true`: end the session's lease when this turn ends.
      ttft_s, tpot_s: the request's latency targets, `x-slo-ttft-ms` and `x-slo-tpot-ms` in seconds (None: the
        worker's defaults): a request whose time-to-first-token target cannot be met is refused at once (429
        with Retry-After), and running requests' time per output token is kept within target
        (model_worker/serving/slo.py).
    """

    key: str | None = None
    ttl: float = 0.0
    release: bool = False
    ttft_s: float | None = None
    tpot_s: float | None = None

    @classmethod
    def from_headers(cls, get) -> Session:
        """The session of a request whose header (or metadata) values `get(name)` returns (None if absent).

        Raises:
          ApiError: 400 naming the header for a ttl that is not a finite number >= 0, or a release flag that is
            not true/false.
        """
        key = get("x-session-id")
        ttl_text, release_text = get("x-session-ttl"), get("x-session-release")
        try:
            ttl = float(ttl_text) if ttl_text else 0.0
        except ValueError:
            ttl = -1.0
        if not (0.0 <= ttl < float("inf")):
            raise ApiError(400, f"x-session-ttl must be a number of seconds >= 0, got {ttl_text[:40]!r}",
                           param="x-session-ttl")
        release = (release_text or "false").strip().lower()
        if release not in ("true", "false", "1", "0"):
            raise ApiError(400, f"x-session-release must be true or false, got {release_text[:40]!r}",
                           param="x-session-release")
        return cls(key[:256] if key else None, ttl, release in ("true", "1"),
                   latency_target(get("x-slo-ttft-ms"), "x-slo-ttft-ms"),
                   latency_target(get("x-slo-tpot-ms"), "x-slo-tpot-ms"))


def latency_target(text: str | None, name: str) -> float | None:
    """A latency target in milliseconds (a header's or a gRPC field's text), as seconds (None when absent).

    Raises:
      ApiError: 400 naming `name` for a value that is not a number of milliseconds in (0, 86,400,000].
    """
    if not text:
        return None
    try:
        ms = float(text)
    except ValueError:
        ms = -1.0
    if not 0.0 < ms <= 86_400_000.0:
        raise ApiError(400, f"{name} must be a number of milliseconds > 0 (at most a day), got {text[:40]!r}",
                       param=name)
    return ms / 1000.0


class Reservation:
    """In-flight generations of one request on its worker: counted when routed (`WorkerPool.reserve`), released
    one by one as they finish; whatever was never released (a request dropped before it ran) is released when
    the reservation is collected, so the count cannot leak."""

    def __init__(self, router: Router, addr: str, count: int):
        self.router, self.addr, self.left = router, addr, count
        router.add_inflight(addr, count)

    def release(self) -> None:
        """One generation finished."""
        if self.left > 0:
            self.left -= 1
            self.router.add_inflight(self.addr, -1)

    def __del__(self):
        if self.left > 0:
            self.router.add_inflight(self.addr, -self.left)
            self.left = 0


def tiebreak_key(parts: list[str]) -> str:
    """A short stable key of a conversation's first messages (the router's tie-break among workers)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()

"""The coordinator's HTTP side: ``/metrics``, ``/sd``, ``/healthz`` and ``/v1/jobs``.

It runs on the same event loop as the gRPC server and reads the same :class:`Membership`, so what
Prometheus discovers and what ``status`` shows can never disagree.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST

from sarcomm.common.addresses import parse_address
from sarcomm.common.errors import InvalidArgumentError, SarcommError
from sarcomm.coordinator.api import validation
from sarcomm.coordinator.api.interceptor import bearer_matches
from sarcomm.coordinator.api.metrics import CoordinatorMetrics
from sarcomm.coordinator.api.views import jobs_json
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.domain.model import Job, Member

log = logging.getLogger(__name__)

COORDINATOR_JOB_LABEL = "sar-coordinator"
#: What answers without the token: nothing in them says where a rank listens. Every other path,
#: ``/sd`` and ``/v1/jobs`` above all, needs it (an allowlist, so that a path added later is
#: protected by default, and so that a caller without the token cannot tell which paths exist).
PUBLIC_PATHS = frozenset({"/metrics", "/healthz"})
#: Ranks turned into /sd target groups between two turns of the event loop.
SD_GROUPS_PER_STEP = 512
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _QuietBadRequests(logging.Filter):
    """Turn aiohttp's ERROR-with-traceback for a malformed request into one DEBUG line.

    A malformed request is the client's problem, answered with 400; logged as an error with a
    traceback, a scanner could fill the coordinator's log (and disk) at will.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.msg, record.args, record.exc_info, record.exc_text = (
            "malformed HTTP request: %s",
            (str(error).splitlines()[0][:200],),
            None,
            None,
        )
        return logging.getLogger().isEnabledFor(logging.DEBUG)


_quiet_bad_requests = _QuietBadRequests()


class HttpApi:
    """The aiohttp application; ``serving`` flips to False when shutdown starts.

    ``membership`` is the leader's (None on a standby): a standby answers ``/v1/jobs`` and ``/sd``
    from ``stored()``, a read-only membership read from the shared store, so Prometheus and users
    can be pointed at any replica. ``role()`` is what ``/healthz`` says about leadership.
    """

    def __init__(
        self,
        membership: Membership | None,
        metrics: CoordinatorMetrics,
        advertised_address: str,
        token: str | None = None,
        stored: Callable[[], Awaitable[Membership]] | None = None,
        role: Callable[[], dict[str, str]] | None = None,
    ) -> None:
        self.membership = membership
        self._stored = stored
        self._role = role or (lambda: {"role": "leader"})
        self._token = token
        self._metrics = metrics
        self._advertised_address = advertised_address
        self.serving = True
        #: Asks a job's reporters by exception for its members' progress and waits, bounded (the
        #: leader's ``ExceptionStreams.gather``; None on a standby).
        self.gather_progress: Callable[[str], Awaitable[None]] | None = None
        aiohttp_server_log = logging.getLogger("aiohttp.server")
        if _quiet_bad_requests not in aiohttp_server_log.filters:
            aiohttp_server_log.addFilter(_quiet_bad_requests)
        self.app = web.Application(middlewares=[self._authenticate])
        self.app.add_routes(
            [
                web.get("/metrics", self.metrics),
                web.get("/healthz", self.healthz),
                web.get("/v1/jobs", self.jobs),
                web.get("/sd", self.service_discovery),
            ]
        )

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """``/sd`` and ``/v1/jobs`` reveal where ranks listen: they need the token when one is set."""
        if (
            self._token is not None
            and request.path not in PUBLIC_PATHS
            and not bearer_matches(request.headers.get("Authorization", ""), self._token)
        ):
            return web.json_response(
                {"error": "unauthenticated"}, status=401, headers={"WWW-Authenticate": "Bearer"}
            )
        return await handler(request)

    async def metrics(self, request: web.Request) -> web.Response:
        # ~30 ms of text for 4096 ranks, all on the loop (a thread would hold the GIL that gRPC's
        # poller needs for every heartbeat): one family at a time, heartbeats go through between.
        parts = []
        with collector_paused():
            render = self._metrics.render(self._metrics.snapshot())
        while True:
            with collector_paused():
                part = next(render, None)
            if part is None:
                break
            parts.append(part)
            await asyncio.sleep(0)
        body = b"".join(parts)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: web.Request) -> web.Response:
        # A standby is healthy (it is ready to take over): 200 with its role, not 503.
        status = "SERVING" if self.serving else "NOT_SERVING"
        return web.json_response({"status": status, **self._role()}, status=200 if self.serving else 503)

    async def _view(self) -> Membership:
        if self.membership is not None:
            return self.membership
        if self._stored is not None:
            try:
                return await self._stored()
            except SarcommError as error:  # a standby that cannot read etcd says so
                raise web.HTTPServiceUnavailable(text=str(error)) from None
        raise web.HTTPServiceUnavailable(text="this coordinator is not serving jobs yet")

    async def jobs(self, request: web.Request) -> web.Response:
        name = request.query.get("job")
        if name:  # the rule gRPC's ListJobs applies (empty: every job, as there)
            try:
                validation.job_name(name)
            except InvalidArgumentError as error:
                raise web.HTTPBadRequest(text=str(error)) from None
        if name and self.gather_progress is not None and self.membership is not None:
            await self.gather_progress(name)
        membership = await self._view()
        jobs = membership.jobs()
        if name:
            jobs = [j for j in jobs if j.name == name]
        with collector_paused():
            body = (await jobs_json(jobs, membership.stall, pause=_let_others_run)).encode()
        return web.Response(body=body, content_type="application/json")

    async def service_discovery(self, request: web.Request) -> web.Response:
        """Prometheus HTTP SD: the full target list on every call, one group per live rank (and
        per worker endpoint a live member reported: a torchrun node's workers)."""
        with collector_paused():
            groups: list[dict[str, object]] = [
                {"targets": [self._advertised_address], "labels": {"job": COORDINATOR_JOB_LABEL}}
            ]
            # Text across the pauses, not dicts: see views.jobs_json.
            pieces = [json.dumps(groups)[1:-1]]
            live = list((await self._view()).live_members())
            for start in range(0, len(live), SD_GROUPS_PER_STEP):
                pieces.append(json.dumps(_groups(live[start : start + SD_GROUPS_PER_STEP]))[1:-1])
                await _let_others_run()
            body = ("[" + ", ".join(p for p in pieces if p) + "]").encode()
        return web.Response(body=body, content_type="application/json")


def _groups(members: list[tuple[Job, Member]]) -> list[dict[str, object]]:
    """One group per endpoint: a member's own (a rank of ``sar-worker`` or ``sar.init``), and one
    per worker endpoint it reported (a torchrun node's workers, ``rank`` the worker's global rank,
    with the node's rank and the worker's local rank besides)."""
    groups: list[dict[str, object]] = []
    for job, member in members:
        target = metrics_target(member)
        if target is not None:
            groups.append(
                {
                    "targets": [target],
                    "labels": {
                        "job": job.name,
                        "rank": str(member.rank),
                        "host": member.host,
                        "generation": str(job.generation),
                    },
                }
            )
        for endpoint in member.worker_endpoints:
            groups.append(
                {
                    "targets": [scrape_target(endpoint.address, member.address)],
                    "labels": {
                        "job": job.name,
                        "rank": str(endpoint.rank),
                        "host": member.host,
                        "generation": str(job.generation),
                        "node_rank": str(member.rank),
                        "local_rank": str(endpoint.local_rank),
                    },
                }
            )
    return groups


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for one synchronous piece of a large answer.

    A 4096-rank answer makes tens of thousands of short-lived containers; collections in the
    middle of it promote them to the oldest generation, which then sets off full collections:
    ~150 ms pauses of every heartbeat with 4096 streams open (measured). Reference counting frees
    these objects (they hold no cycles) the moment the piece is done.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


async def _let_others_run() -> None:
    # Between two pieces of a large answer: heartbeats run, with the collector as usual.
    paused = not gc.isenabled()
    if paused:
        gc.enable()
    try:
        await asyncio.sleep(0)
    finally:
        if paused:
            gc.disable()


def metrics_target(member: Member) -> str | None:
    """Where Prometheus scrapes a member: its reported endpoint (see :func:`scrape_target`)."""
    if not member.metrics_address:
        return None
    return scrape_target(member.metrics_address, member.address)


def scrape_target(metrics_address: str, member_address: str) -> str:
    """``metrics_address`` (``host:port``) with a wildcard host replaced by ``member_address``, the
    address the coordinator handed the member (a rank listening on 0.0.0.0 is reachable there)."""
    host, _, port = metrics_address.rpartition(":")
    host = host.strip("[]")
    parsed = parse_address(host)
    if parsed is not None and parsed.is_unspecified and member_address:
        host = member_address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

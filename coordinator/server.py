"""Assembles the coordinator: state store, membership, gRPC server, HTTP side, liveness sweeper.

:func:`serve` runs until SIGTERM/SIGINT (or ``stop`` is set), then shuts down gracefully: health
goes NOT_SERVING first, in-flight RPCs get ``shutdown_grace`` seconds, then everything closes. A
coordinator whose leader election ended on an error shuts down the same way, then raises it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import ssl
import time
from collections.abc import Iterator

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sarcomm.common.addresses import host_port, parse_host_port
from sarcomm.common.errors import CoordinatorFailedError
from sarcomm.common.tasks import cancel_and_wait
from sarcomm.common.tls import read_token_file, server_credentials, server_ssl_context
from sarcomm.coordinator import fdlimit, systemd
from sarcomm.coordinator.api.http import HttpApi
from sarcomm.coordinator.api.interceptor import StatusInterceptor
from sarcomm.coordinator.api.metrics import CoordinatorMetrics
from sarcomm.coordinator.config import CoordinatorConfig
from sarcomm.coordinator.domain import liveness
from sarcomm.coordinator.domain.clock import SYSTEM_CLOCK, Clock
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.ha.replica import Replica
from sarcomm.coordinator.ha.router import LeaderRouter
from sarcomm.coordinator.ha.seat import Seat, SoleSeat
from sarcomm.coordinator.storage.store import StateStore
from sarcomm.coordinator.term import Term
from sarcomm.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
HANDSHAKE_TIMEOUT_MS = 10_000
# How often the loop-lag watcher checks that the event loop keeps up (20 cheap wake-ups a second).
LOOP_LAG_PERIOD_S = 0.05
#: Middle-generation collections before a full one is considered (Python's default: 10).
FULL_COLLECTION_THRESHOLD = 100


@contextlib.contextmanager
def _stop_on_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> Iterator[None]:
    """Set ``stop`` on SIGTERM/SIGINT while inside; the previous handlers come back on exit."""
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
            pass
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


class Coordinator:
    """One running coordinator; ``grpc_port``/``http_port`` are the bound ports once started.

    ``clock`` is what liveness, stalls and timestamps read (tests pass a fake one; see
    ``tests/coordinator_fixture.py``); the timers of the service itself stay on the event loop.
    """

    def __init__(self, config: CoordinatorConfig, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.clock = clock
        self.metrics = CoordinatorMetrics(None, wall=clock.wall)
        # Set when a part that must run for as long as the coordinator does ended (the election).
        self.failure: CoordinatorFailedError | None = None
        self.failed = asyncio.Event()
        # The jobs this coordinator serves, from the term its seat holds: on SQLite one term for as
        # long as it runs; on etcd one per time it leads (None while it stands by).
        self.seat: Seat = (
            SoleSeat(config, clock, self.metrics)
            if config.store is None
            else Replica(config, config.store, clock, self.metrics, self._term_changed, self._failed)
        )
        self.store: StateStore = self.seat.store
        self.term: Term | None = self.seat.term
        self.metrics.membership = self.term.membership if self.term is not None else None
        # grpc-stubs predates the asyncio health servicer, hence the ignore.
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        http_host, http_port = parse_host_port("http", config.http)
        advertised = f"{socket.gethostname() if http_host in ('0.0.0.0', '::') else http_host}:{http_port}"
        self.token = read_token_file(config.token_file) if config.token_file else None
        # Built here, before anything listens, so that unusable TLS files stop the start with a
        # message naming the file instead of a listener that fails every handshake.
        self.tls_context: ssl.SSLContext | None = None
        self._grpc_credentials: grpc.ServerCredentials | None = None
        if config.tls_cert is not None and config.tls_key is not None:
            self.tls_context = server_ssl_context(config.tls_cert, config.tls_key, config.tls_client_ca)
            self._grpc_credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        self.http = HttpApi(
            self.term.membership if self.term is not None else None,
            self.metrics,
            advertised,
            self.token,
            stored=self.seat.stored_view,
            role=self.seat.role,
        )
        # /v1/jobs?job=NAME asks the job's by-exception reporters for its progress first.
        self.http.gather_progress = self.term.service.streams.gather if self.term is not None else None
        self.grpc_port = 0
        self.http_port = 0
        # The gRPC servers on --listen's port: one, or --acceptors of them sharing it.
        self._servers: list[grpc.aio.Server] = []
        self._interceptor = StatusInterceptor(self.metrics, self.token, config.limits.max_streams)
        self._runner: web.AppRunner | None = None
        self._lag_watcher: asyncio.Task[None] | None = None
        self._file_watch: asyncio.Task[None] | None = None
        # The health status changes not yet applied: kept, since the loop holds only weak
        # references to tasks (one could be collected before it ran), and awaited by stop.
        self._health_updates: set[asyncio.Task[None]] = set()
        self._gc_started = 0.0

    @property
    def membership(self) -> Membership:
        """The membership being served (on etcd, the current term's; raises while standing by)."""
        if self.term is None:
            raise RuntimeError("this coordinator stands by: it serves no membership")
        return self.term.membership

    def _term_changed(self, term: Term | None) -> None:
        self.term = term
        self.metrics.membership = self.http.membership = term.membership if term is not None else None
        self.http.gather_progress = term.service.streams.gather if term is not None else None
        status = (
            health_pb2.HealthCheckResponse.SERVING if term else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        update = asyncio.get_running_loop().create_task(self.health.set(SERVICE_NAME, status))
        self._health_updates.add(update)
        update.add_done_callback(self._health_updates.discard)

    def _failed(self, error: CoordinatorFailedError) -> None:
        log.error("%s: shutting down", error)
        self.failure = error
        self.failed.set()

    def _grpc_server(self, shared_port: bool) -> grpc.aio.Server:
        """One gRPC server of the coordinator's service, configured as every one of them is
        (``shared_port``: one of several on one port, see ``--acceptors``)."""
        limits = self.config.limits
        ping_every, answer_within = liveness.keepalive_settings(self.config.liveness_timeout)
        server = grpc.aio.server(
            interceptors=[self._interceptor],
            options=[
                ("grpc.max_receive_message_length", limits.max_message_bytes),
                ("grpc.max_send_message_length", limits.max_message_bytes),
                # Clients ping every 20 s to keep long Join/Watch calls alive through NATs.
                # One coordinator per port: gRPC sets SO_REUSEPORT by default, and the kernel would
                # split new connections between two coordinators on one port. Only this process's
                # own acceptors share one (_check_free refuses a port another process holds).
                ("grpc.so_reuseport", 1 if shared_port else 0),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
                # Pings from here tell a busy reporter (its gRPC core answers without the GIL)
                # from a stopped or gone one (see liveness.keepalive_settings); gRPC would stop
                # pinging a quiet stream after 2 pings without data.
                ("grpc.keepalive_time_ms", int(ping_every * 1000)),
                ("grpc.keepalive_timeout_ms", int(answer_within * 1000)),
                ("grpc.http2.ping_timeout_ms", int(answer_within * 1000)),
                ("grpc.http2.max_pings_without_data", 0),
                # A connection that has not finished its (TLS and HTTP/2) handshake after this is
                # dropped: half-open connections from scanners must not pile up (default 120 s).
                ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
                # A world forms only when all its members' joins are waiting at once; gRPC's
                # default of 1000 pending calls would refuse members of larger worlds at random.
                ("grpc.server.max_pending_requests", 2 * limits.max_world_size),
                ("grpc.server.max_pending_requests_hard_limit", 4 * limits.max_world_size),
            ],
        )
        servicer = LeaderRouter(self.seat.serving_term, self.seat.not_leader)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        return server

    def _bind(self, server: grpc.aio.Server, address: str) -> int:
        try:
            if self._grpc_credentials is not None:
                return server.add_secure_port(address, self._grpc_credentials)
            return server.add_insecure_port(address)
        except RuntimeError:  # grpc: "Failed to bind to address"
            return 0

    async def start(self) -> None:
        acceptors = self.config.acceptors
        server = self._grpc_server(acceptors > 1)
        # Stopped on any failure below: a gRPC server left for the garbage collector tries to stop
        # itself on a loop that is gone ("Exception ignored in Server.__del__").
        self._servers = [server]
        try:
            _check_free("--listen", self.config.listen)
            self.grpc_port = self._bind(server, self.config.listen)
            if self.grpc_port == 0:
                raise OSError(_in_use("--listen", self.config.listen))
            # The acceptors after the first listen on the port it got (--listen HOST:0 included).
            bound = host_port(parse_host_port("--listen", self.config.listen)[0], self.grpc_port)
            for _ in range(acceptors - 1):
                more = self._grpc_server(True)
                self._servers.append(more)
                if self._bind(more, bound) != self.grpc_port:
                    raise OSError(_in_use("--listen", self.config.listen))
            for each in self._servers:
                await each.start()
            await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
            # The Coordinator service is SERVING only while a term serves (on etcd: while leading).
            await self.health.set(
                SERVICE_NAME,
                health_pb2.HealthCheckResponse.SERVING
                if self.term is not None
                else health_pb2.HealthCheckResponse.NOT_SERVING,
            )

            host, port = parse_host_port("http", self.config.http)
            runner = web.AppRunner(self.http.app, access_log=None, handle_signals=False)
            await runner.setup()
            self._runner = runner
            site = web.TCPSite(runner, host, port, ssl_context=self.tls_context)
            try:
                await site.start()
            except OSError as error:
                raise OSError(_in_use("--http", self.config.http, error)) from None
        except BaseException:
            await self._close_listeners()
            raise
        self.http_port = int(runner.addresses[0][1]) if runner.addresses else port
        advertised = self.config.advertised
        if parse_host_port("advertise", advertised)[1] == 0:  # --listen HOST:0: the bound port
            advertised = host_port(advertised.rpartition(":")[0].strip("[]"), self.grpc_port)
        self.seat.start(advertised)
        self._lag_watcher = asyncio.create_task(self._watch_loop_lag(), name="loop-lag-watcher")
        files = fdlimit.FileBudget(fdlimit.open_file_limit(), fdlimit.open_files() or 0)
        self.metrics.open_file_limit.set(files.limit)
        watch = fdlimit.FileLimitWatch(files, self.metrics.open_file_limit_reached.inc)
        self._file_watch = asyncio.create_task(watch.run(), name="open-file-watch")
        # Everything allocated so far lives as long as the process: keep the collector off it.
        gc.freeze()
        # A full collection walks every object of every open stream: ~150 to 400 ms with 4096
        # single-rank streams, every ack waiting (measured). Python's default considers one after
        # 10 middle-generation collections; at 100 it comes ten times less often, while the young
        # collections still free what dies young (cycles of finished calls included).
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, FULL_COLLECTION_THRESHOLD)
        gc.callbacks.append(self._time_gc)
        log.info(
            "coordinator serving gRPC on %s (port %d), HTTP on %s (port %d), state %s, liveness %g s x %d, "
            "TLS %s, token %s, %s",
            self.config.listen,
            self.grpc_port,
            self.config.http,
            self.http_port,
            self.config.store.describe() if self.config.store else self.config.state or "in memory",
            self.config.heartbeat_interval,
            self.config.heartbeat_misses,
            "mutual" if self.config.tls_client_ca else "on" if self.tls_context else "off",
            "required" if self.token else "off",
            files.describe(),
        )

    def _time_gc(self, phase: str, info: dict[str, int]) -> None:
        # A full collection walks every object the coordinator holds (thousands of streams' worth):
        # it is the pause that most often holds up heartbeats, so it is measured where it happens.
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            self.metrics.gc_pause.labels(str(info.get("generation", "?"))).observe(
                time.perf_counter() - self._gc_started
            )
            self._gc_started = 0.0

    async def _watch_loop_lag(self) -> None:
        # Everything the coordinator does shares one loop: a step that holds it (a large scrape, a
        # big state write) delays every heartbeat ack. This measures that delay from the inside.
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await asyncio.sleep(LOOP_LAG_PERIOD_S)
            self.metrics.loop_lag.observe(max(0.0, loop.time() - began - LOOP_LAG_PERIOD_S))

    async def _close_listeners(self, grace: float | None = None) -> None:
        servers, self._servers = self._servers, []
        if servers:
            await asyncio.gather(*(server.stop(grace) for server in servers))
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def stop(self) -> None:
        log.info(
            "shutting down: health NOT_SERVING, %g s grace for in-flight calls", self.config.shutdown_grace
        )
        self.http.serving = False
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._time_gc)
        # A term's change still on its way must not set SERVING again after the shutdown's status.
        await asyncio.gather(*self._health_updates)
        await self.health.enter_graceful_shutdown()
        for watcher in (self._lag_watcher, self._file_watch):
            await cancel_and_wait(watcher)
        await self._close_listeners(self.config.shutdown_grace)
        await self.seat.stop()
        log.info("coordinator stopped")


def _check_free(flag: str, address: str) -> None:
    """Bind ``address`` for a moment, as the listener will, to fail with one line before gRPC
    logs its own multi-line complaint. A port that is taken raises OSError naming ``flag``."""
    host, port = parse_host_port(flag, address)
    if port == 0:
        return
    for family, kind, proto, _, where in socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as error:
                raise OSError(_in_use(flag, address, error)) from None


def _in_use(flag: str, address: str, error: OSError | None = None) -> str:
    cause = "address already in use"
    if error is not None and error.errno:
        cause = os.strerror(error.errno).lower()
    return (
        f"{flag} {address}: cannot listen there ({cause}); another process (another sar-coordinator?) "
        f"holds the port: stop it or choose another {flag}"
    )


async def serve(config: CoordinatorConfig, stop: asyncio.Event | None = None) -> None:
    """Run a coordinator until SIGTERM/SIGINT or until ``stop`` is set.

    Raises:
        CoordinatorFailedError: its leader election ended on an error (after shutting down).
    """
    stop = stop or asyncio.Event()
    coordinator = Coordinator(config)
    with _stop_on_signals(asyncio.get_running_loop(), stop):
        await coordinator.start()
        ports = f"gRPC on port {coordinator.grpc_port}, HTTP on port {coordinator.http_port}"
        systemd.notify(f"READY=1\nSTATUS=serving {ports}")
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(coordinator.failed.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            systemd.notify("STOPPING=1\nSTATUS=shutting down")
            await coordinator.stop()
    if coordinator.failure is not None:
        raise coordinator.failure

"""Plain helpers shared by the tests (fixtures stay in ``conftest.py``).

- Waits with deadlines: :func:`wait_for` and its async twin :func:`wait_for_async` poll a
  condition until it holds; :func:`stays_false` and :func:`stays_false_async` are the bounded wait
  for "nothing happens for N seconds". Each fails naming what it waited for, and never waits
  longer than its timeout: no test waits with a fixed sleep.
- gRPC streams: :func:`read_message` (the next message, with a deadline).
- Ports: :func:`free_port` (the product's own, :func:`sarcomm.common.netinfo.free_port`: one
  implementation for the tests, the fixtures and the client) and :func:`free_port_run`
  (consecutive ports).
- The coordinator's views as plain JSON: :func:`sd_groups`, :func:`wait_for_sd`.
- Test doubles shared by several files: :class:`FakeClock` (the one clock a test moves by hand),
  :func:`spec` (a membership Join),
  :func:`nic`, :data:`LO` and :data:`LO_PB`.

Nothing here imports pytest, so the rank scripts under ``tests/scripts`` can use it too.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import json
import socket
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias, TypeVar, overload

import grpc

from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.common.netinfo import free_port as free_port  # re-exported: the one free_port
from sarcomm.coordinator.domain.membership import JoinSpec, Member, MemberRequest
from sarcomm.v1 import coordinator_pb2 as pb

# The `sar-worker` command as this interpreter runs it (the installed script may be another venv's).
SAR_WORKER: list[str] = [sys.executable, "-m", "sarcomm.worker.agent.cli"]

T = TypeVar("T")
R = TypeVar("R")

#: How long a test waits on a coordinator or a process unless it says otherwise, in seconds.
DEFAULT_TIMEOUT_S = 15.0
#: How often the waits below look again, in seconds.
POLL_S = 0.05

#: The loopback interface as a worker reports it, in the library's type and on the wire.
LO = InterfaceInfo("lo", ("127.0.0.1",), InterfaceKind.LOOPBACK)
LO_PB = pb.NetworkInterface(name="lo", addresses=["127.0.0.1"], kind=pb.INTERFACE_KIND_LOOPBACK)


class WaitTimeout(AssertionError):
    """Raised when a condition did not hold (or a "nothing happens" did) within the timeout.

    An ``AssertionError``, so that pytest reports it as a failed check, in a test and in a rank
    process alike.
    """


#: What a wait waits for: a description, or a function that gives one (called only when the
#: wait fails, so it can include a log or the state at that moment).
What: TypeAlias = str | Callable[[], str]


def _describe(what: What) -> str:
    return what if isinstance(what, str) else what()


def _timed_out(what: What, timeout: float, last: object) -> WaitTimeout:
    return WaitTimeout(f"timed out after {timeout:g} s waiting for {_describe(what)}; last: {last!r}")


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    what: What,
    interval: float = POLL_S,
) -> T:
    """The first truthy value of ``predicate()``, called every ``interval`` seconds.

    Blocks. Raises :class:`WaitTimeout` naming ``what`` (a string, or a function called then) and
    the last value when ``timeout``
    seconds pass first. ``predicate`` is always called at least once, and once more at the
    deadline. Falsy values (``None``, ``False``, ``0``, ``[]``) mean "not yet".
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise _timed_out(what, timeout, value)
        time.sleep(min(interval, left))


@overload
async def wait_for_async(
    predicate: Callable[[], Awaitable[T | None]],
    timeout: float = ...,
    *,
    what: What,
    interval: float = ...,
) -> T: ...


@overload
async def wait_for_async(
    predicate: Callable[[], T | None],
    timeout: float = ...,
    *,
    what: What,
    interval: float = ...,
) -> T: ...


async def wait_for_async(
    predicate: Callable[[], Any],
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    what: What,
    interval: float = POLL_S,
) -> Any:
    """:func:`wait_for` for a test on the event loop: ``predicate`` may be a plain function or
    return an awaitable (an ``async def`` or a lambda calling one), which is awaited.

    Sleeps on the loop between calls, so other tasks run. Raises :class:`WaitTimeout`.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise _timed_out(what, timeout, value)
        await asyncio.sleep(min(interval, left))


def stays_false(
    predicate: Callable[[], object], duration: float, *, what: What, interval: float = POLL_S
) -> None:
    """Check ``predicate()`` every ``interval`` seconds for ``duration`` seconds; it must stay
    falsy. For tests whose subject is time passing ("nobody is judged during a 1.5 s outage").

    Blocks for ``duration`` seconds when all is well. Raises :class:`WaitTimeout` (an
    ``AssertionError``) naming ``what`` as soon as ``predicate()`` is truthy.
    """
    deadline = time.monotonic() + duration
    while True:
        value = predicate()
        if value:
            raise WaitTimeout(f"{_describe(what)} happened within {duration:g} s (it must not): {value!r}")
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(interval, left))


async def stays_false_async(
    predicate: Callable[[], object], duration: float, *, what: What, interval: float = POLL_S
) -> None:
    """:func:`stays_false` on the event loop (``predicate`` may return an awaitable)."""
    deadline = time.monotonic() + duration
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            raise WaitTimeout(f"{_describe(what)} happened within {duration:g} s (it must not): {value!r}")
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(interval, left))


async def read_message(
    call: grpc.aio.UnaryStreamCall[Any, Any] | grpc.aio.StreamStreamCall[Any, Any],
    message_type: type[R],
    timeout: float = DEFAULT_TIMEOUT_S,
) -> R:
    """The next message of a gRPC stream, a ``message_type``, within ``timeout`` seconds.

    Raises ``asyncio.TimeoutError`` when none comes in time and :class:`WaitTimeout` when the
    stream ends first (``grpc.aio.EOF``) or sends something else.
    """
    message = await asyncio.wait_for(call.read(), timeout)
    if not isinstance(message, message_type):
        raise WaitTimeout(f"expected a {message_type.__name__} from the stream, got {message!r}")
    return message


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports nothing listens on now: all are bound at once before any is
    let go, so two of them are never the same port (two :func:`free_port` calls may be)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port_run(count: int) -> int:
    """A port P such that P..P+count-1 were all free a moment ago (a fixed --metrics-port gives
    local rank i the port P+i: a busy P+1 would leave that rank without an endpoint).

    Raises ``RuntimeError`` when 100 tries find no such run.
    """
    for _ in range(100):
        first = free_port()
        socks: list[socket.socket] = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("", port))
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no run of {count} free ports found")


def sd_groups(http_url: str, job: str) -> list[dict[str, Any]]:
    """The coordinator's ``GET /sd`` target groups labelled with ``job``."""
    with urllib.request.urlopen(f"{http_url}/sd", timeout=5) as response:
        groups: list[dict[str, Any]] = json.loads(response.read())
    return [g for g in groups if g["labels"].get("job") == job]


def wait_for_sd(http_url: str, job: str, world: int, timeout: float = 20.0) -> list[dict[str, Any]]:
    """The ``/sd`` groups of ``job`` once it lists all ``world`` ranks (each rank's metrics port
    reaches the coordinator with that rank's next heartbeat). Raises :class:`WaitTimeout`."""

    def complete() -> list[dict[str, Any]] | None:
        groups = sd_groups(http_url, job)
        return groups if len(groups) == world else None

    return wait_for(complete, timeout, what=f"/sd to list the {world} ranks of job {job!r}", interval=0.1)


class FakeClock:
    """The coordinator's two clocks (:class:`sarcomm.coordinator.domain.clock.Clock`), moved only
    by the test: :meth:`advance` moves both by the same seconds.

    ``monotonic`` starts at 1000 (any value: a new process's clock starts anywhere) and ``wall``
    at a plausible Unix time (what users see, and what real clients' stamps are compared with).
    """

    def __init__(self, monotonic: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._monotonic = monotonic
        self._wall = wall

    def monotonic(self) -> float:
        return self._monotonic

    def wall(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        self._monotonic += seconds
        self._wall += seconds


def assigned_rank(member: Member) -> int:
    """``member.rank``, which a member of a formed world always has (fails otherwise)."""
    assert member.rank is not None, f"member {member.member_id} has no rank yet"
    return member.rank


def nic(address: str) -> InterfaceInfo:
    """A routable physical interface ``eth0`` with ``address``, on the default route."""
    return InterfaceInfo("eth0", (address,), InterfaceKind.PHYSICAL, default_route=True)


def spec(
    host: str,
    *ranks: int | None,
    job: str = "gnn",
    world_size: int = 4,
    peer: str = "127.0.0.1",
    generation: int = 0,
    address: str | None = None,
    port: int = 29500,
) -> JoinSpec:
    """A Join as the coordinator's membership sees it: one member per entry of ``ranks`` (a
    requested rank or ``None``; one unranked member without any), on ``host``."""
    members = tuple(MemberRequest(local_rank=i, rank=r) for i, r in enumerate(ranks or (None,)))
    interfaces = (LO, nic(address)) if address else (LO,)
    return JoinSpec(
        job=job,
        world_size=world_size,
        host=host,
        interfaces=interfaces,
        members=members,
        store_port=port,
        generation=generation,
        peer_address=peer,
    )


def port_taken(port: int) -> bool:
    """Whether some socket holds ``port`` on every IPv4 address: a plain bind is refused."""
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            return True
    return False

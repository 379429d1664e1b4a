"""Shared fixtures: a real ``sar-coordinator`` process on loopback for each test that asks, the etcd
clusters, and the tiers (``tests/tiers.py``: every test is fast, integration or system)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest

from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.storage.etcd_config import EtcdSettings

# The three-member etcd clusters of the etcd store and failover tests, as fixtures for every file.
from tests.etcd_cluster import etcd_cluster, etcd_prefix, module_etcd_cluster  # noqa: F401
from tests.helpers import WaitTimeout, free_ports, wait_for

# The tiers: each test's marker, given at collection, and the fast tier's guard.
from tests.tiers import (  # noqa: F401
    pytest_collection_modifyitems,
    pytest_runtest_setup,
    pytest_runtest_teardown,
    real_processes,
)


def netns_unavailable() -> str:
    """Why tests that build hosts from network namespaces cannot run here, or "" when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    return ""


@dataclass
class CoordinatorProcess:
    """A ``sar-coordinator`` started as a child process; ``stop()`` sends SIGTERM and waits."""

    grpc_port: int
    http_port: int
    state_path: Path | None
    args: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    # Set for a coordinator started with --tls-cert: its HTTP side then speaks HTTPS only.
    http_ssl: ssl.SSLContext | None = None
    # How to start it; the default is this checkout's module under this interpreter.
    command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "sarcomm.coordinator.cli"])
    # The address tests reach it at (gRPC and HTTP), e.g. a network namespace's, and the one it
    # listens on when that differs (0.0.0.0).
    host: str = "127.0.0.1"
    listen_host: str | None = None

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{'https' if self.http_ssl else 'http'}://{self.host}:{self.http_port}"

    def start(self, timeout: float = 20.0) -> None:
        cmd = [
            *self.command,
            "--listen",
            f"{self.listen_host or self.host}:{self.grpc_port}",
            "--http",
            f"{self.listen_host or self.host}:{self.http_port}",
            *(["--state", str(self.state_path)] if self.state_path else []),
            *self.args,
        ]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
        )
        proc = self.proc

        def healthy() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"coordinator exited with {proc.returncode}: {self.log()}")
            try:
                with urllib.request.urlopen(
                    f"{self.http_url}/healthz", timeout=1, context=self.http_ssl
                ) as resp:
                    return bool(resp.status == 200)
            except OSError:
                return False

        try:
            wait_for(healthy, timeout, what=f"{self.http_url}/healthz to answer 200")
        except WaitTimeout as exc:
            self.kill()  # a start that failed leaves no process behind
            raise TimeoutError(f"coordinator not healthy within {timeout} s: {self.log()}") from exc

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def get_json(self, path: str) -> object:
        with urllib.request.urlopen(f"{self.http_url}{path}", timeout=5, context=self.http_ssl) as resp:
            return json.loads(resp.read())

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(f"{self.http_url}{path}", timeout=5, context=self.http_ssl) as resp:
            return str(resp.read().decode())


class StartCoordinator(Protocol):
    """The type of the ``start_coordinator`` fixture: starts a coordinator with ``args`` (and a
    SQLite state file unless ``state=False``), waits until it is healthy and returns it."""

    def __call__(
        self,
        *args: str,
        state: bool = True,
        env: dict[str, str] | None = None,
        http_ssl: ssl.SSLContext | None = None,
    ) -> CoordinatorProcess: ...


#: The two stores, as parameters: the etcd one needs etcd (the ``etcd`` marker: the system tier).
STORES = ["sqlite", pytest.param("etcd", marks=pytest.mark.etcd)]


#: The operations of a Membership after which its invariants are checked (see membership_invariants).
MEMBERSHIP_OPERATIONS = (
    "join", "answered", "abandon", "heartbeat", "beats", "leave", "close_job", "stream_lost",
    "stream_closed", "sweep", "took_policy",
)  # fmt: skip


@pytest.fixture
def membership_invariants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Membership of the test checks its invariants (:meth:`Membership.check_invariants`)
    after each of its operations, refused ones included. A domain test module asks for it with
    ``pytestmark = pytest.mark.usefixtures("membership_invariants")``: a check walks every job and
    member, so a test of a world of thousands would be quadratic with it."""
    for name in MEMBERSHIP_OPERATIONS:
        operation = getattr(Membership, name)

        def checked(self: Membership, *args: object, _operation: Any = operation, **kwargs: object) -> Any:
            try:
                return _operation(self, *args, **kwargs)
            finally:
                self.check_invariants()

        monkeypatch.setattr(Membership, name, checked)


@pytest.fixture(params=STORES)
def state_backend(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, object]:
    """Where a coordinator keeps its jobs, once per store: ``{"state": PATH}`` (SQLite) or
    ``{"store": EtcdSettings}`` under a prefix of the test's own on the module's etcd cluster
    (skipped without etcd), as keyword arguments of :class:`CoordinatorConfig` (and of
    ``in_process_coordinator``)."""
    if request.param == "sqlite":
        return {"state": tmp_path / "state.sqlite"}
    cluster = request.getfixturevalue("module_etcd_cluster")
    return {"store": EtcdSettings(cluster.url(request.getfixturevalue("etcd_prefix")), leader_ttl=1)}


def store_args(backend: dict[str, object]) -> list[str]:
    """The ``sar-coordinator`` flags of a :func:`state_backend`."""
    if "state" in backend:
        return ["--state", str(backend["state"])]
    store = backend["store"]
    assert isinstance(store, EtcdSettings)
    return ["--store", store.url, "--leader-ttl", str(store.leader_ttl)]


@pytest.fixture
def start_coordinator(tmp_path: Path) -> Iterator[StartCoordinator]:
    """Factory: ``start_coordinator(*extra_args, state=True)`` starts a coordinator and returns it."""
    started: list[CoordinatorProcess] = []

    def _start(
        *args: str,
        state: bool = True,
        env: dict[str, str] | None = None,
        http_ssl: ssl.SSLContext | None = None,
    ) -> CoordinatorProcess:
        grpc_port, http_port = free_ports(2)
        coord = CoordinatorProcess(
            grpc_port=grpc_port,
            http_port=http_port,
            state_path=tmp_path / f"state{len(started)}.sqlite" if state else None,
            args=list(args),
            log_path=tmp_path / f"coordinator{len(started)}.log",
            env=env or {},
            http_ssl=http_ssl,
        )
        coord.start()
        started.append(coord)
        return coord

    yield _start
    for coord in started:
        coord.stop()


@pytest.fixture(scope="module")
def module_coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    """One coordinator shared by a module's tests (for fixtures that run a world once per module)."""
    directory = tmp_path_factory.mktemp("coordinator")
    grpc_port, http_port = free_ports(2)
    coord = CoordinatorProcess(
        grpc_port=grpc_port,
        http_port=http_port,
        state_path=directory / "state.sqlite",
        args=["--heartbeat-interval", "0.5", "--join-timeout", "60"],
        log_path=directory / "coordinator.log",
    )
    coord.start()
    yield coord
    coord.stop()


@pytest.fixture
def coordinator(start_coordinator: StartCoordinator) -> CoordinatorProcess:
    """One coordinator with a SQLite state file, short heartbeat settings for fast tests."""
    return start_coordinator("--heartbeat-interval", "0.5", "--join-timeout", "60")

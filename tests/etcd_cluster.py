"""A real three-member etcd cluster on loopback, for the tests of the etcd store and of failover.

:class:`EtcdCluster` starts ``etcd`` (Debian's ``etcd-server``, 3.4) three times in a temporary
folder, each member on free ports, and waits until the cluster answers through every member (a
second or two). It can SIGKILL, stop and restart one member, lose the quorum (stop two) and get it
back, and tears down leaving no process behind: each member also dies with the test process
(``setpriv --pdeathsig``), so even a killed pytest leaves none.

``client_tls`` (CA, certificate, key: PEM files) makes the members speak TLS to clients and require
a client certificate signed by that CA (etcd's ``--client-cert-auth``); the same certificate
serves as the tests' client certificate. ``extra_hosts`` makes every member also listen for
clients on those addresses (e.g. a bridge address that a coordinator in a network namespace
reaches); ``enable_v2`` turns on etcd's v2 API (torch elastic's ``etcd`` rendezvous backend speaks
v2 only); ``extra_args`` are more flags for every member (e.g. ``--max-request-bytes``).

Two pytest fixtures, each skipped, saying so, only when the ``etcd`` binary is absent:

- :func:`module_etcd_cluster`: one cluster for a whole test module, for the tests that only use
  etcd (the store contract, coordinators on etcd). It refuses to kill, stop or restart a member;
  each test keeps its keys under a prefix of its own (:func:`etcd_prefix`, a fixture).
- :func:`etcd_cluster`: a fresh cluster for one test, which may kill members and lose the quorum.

Benchmarks use :func:`running_cluster` too.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import free_ports

#: Why etcd tests cannot run here, or "" when they can.
ETCD_MISSING = (
    ""
    if shutil.which("etcd") and shutil.which("etcdctl")
    else "needs etcd and etcdctl (Debian package etcd-server; .ci/run installs it)"
)
#: How long a start or a restart may take before it is a failure, in seconds.
START_TIMEOUT_S = 30.0


def _die_with_parent() -> list[str]:
    """The command prefix that makes etcd get SIGKILL when the process that started it dies.

    util-linux's ``setpriv --pdeathsig`` rather than a ``preexec_fn``: Python code between fork
    and exec in a process with gRPC threads (the tests' clients) crashes the child at random.
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL"] if setpriv else []


#: How many times :meth:`EtcdCluster.start` starts a new cluster when a chosen port was taken.
PORT_TRIES = 3
#: What etcd's log says when a port it was given is in use.
PORT_TAKEN = "address already in use"


@dataclass
class EtcdMember:
    """One etcd process: its name, ports, data folder and log."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT``: where clients reach this member on loopback."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""


@dataclass
class EtcdCluster:
    """Three etcd members in ``root``; :meth:`start` brings them up, :meth:`close` ends them."""

    root: Path
    size: int = 3
    extra_hosts: Sequence[str] = ()
    enable_v2: bool = False
    client_tls: tuple[Path, Path, Path] | None = None
    extra_args: Sequence[str] = ()
    #: Set on a cluster that several tests share (:func:`module_etcd_cluster`): they may not kill,
    #: stop or restart its members.
    shared: bool = False
    members: list[EtcdMember] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._choose_ports()

    def _choose_ports(self) -> None:
        """Give every member a client and a peer port, all distinct."""
        ports = free_ports(2 * self.size)
        self.members = [
            EtcdMember(
                name=f"m{i}",
                client_port=ports[2 * i],
                peer_port=ports[2 * i + 1],
                data_dir=self.root / f"m{i}.etcd",
                log_path=self.root / f"m{i}.log",
            )
            for i in range(self.size)
        ]

    # -- addresses -------------------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """Every member's ``127.0.0.1:PORT``."""
        return [m.endpoint for m in self.members]

    @property
    def scheme(self) -> str:
        return "https" if self.client_tls else "http"

    def url(self, prefix: str = "", host: str = "127.0.0.1") -> str:
        """The ``--store`` value for a coordinator: ``etcd://H:P1,H:P2,H:P3[/prefix]`` (``host`` one
        of 127.0.0.1 and ``extra_hosts``)."""
        hosts = ",".join(f"{host}:{m.client_port}" for m in self.members)
        return f"etcd://{hosts}{'/' + prefix.strip('/') if prefix else ''}"

    # -- life cycle ------------------------------------------------------------------------------

    def _command(self, member: EtcdMember, state: str) -> list[str]:
        hosts = ["127.0.0.1", *self.extra_hosts]
        cluster = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        tls: list[str] = []
        if self.client_tls is not None:
            ca, cert, key = self.client_tls
            tls = [
                "--cert-file",
                str(cert),
                "--key-file",
                str(key),
                "--trusted-ca-file",
                str(ca),
                "--client-cert-auth",
            ]
        return [
            "etcd",
            *tls,
            "--name",
            member.name,
            "--data-dir",
            str(member.data_dir),
            "--listen-client-urls",
            ",".join(f"{self.scheme}://{h}:{member.client_port}" for h in hosts),
            "--advertise-client-urls",
            f"{self.scheme}://127.0.0.1:{member.client_port}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{member.peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{member.peer_port}",
            "--initial-cluster",
            cluster,
            "--initial-cluster-state",
            state,
            "--initial-cluster-token",
            f"sarcomm-test-{self.root.name}",
            # Loopback: elections in a fraction of a second instead of etcd's 1 s default.
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            "--enable-v2=" + ("true" if self.enable_v2 else "false"),
            "--logger",
            "zap",
            "--log-level",
            "warn",
            *self.extra_args,
        ]

    def _spawn(self, member: EtcdMember, state: str) -> None:
        log = member.log_path.open("ab")
        try:
            member.proc = subprocess.Popen(
                [*_die_with_parent(), *self._command(member, state)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()

    def start(self, timeout: float = START_TIMEOUT_S) -> EtcdCluster:
        """Start every member and wait until each one answers as part of a healthy cluster.

        A free port can be taken by another process (an outgoing connection's ephemeral port)
        between choosing it and etcd binding it: then the new cluster starts again on fresh ports
        and data folders, up to :data:`PORT_TRIES` times in all.
        """
        for tries in range(1, PORT_TRIES + 1):
            self.root.mkdir(parents=True, exist_ok=True)
            for member in self.members:
                self._spawn(member, "new")
            try:
                for member in self.members:
                    self.wait_member(member, timeout)
                return self
            except RuntimeError as error:
                self.close()
                if PORT_TAKEN not in str(error) or tries == PORT_TRIES:
                    raise
                self._choose_ports()
            except BaseException:
                self.close()
                raise
        raise AssertionError("unreachable: the last try returns or raises")

    def wait_member(self, member: EtcdMember, timeout: float = START_TIMEOUT_S) -> None:
        """Return once ``member`` answers /health as healthy (it has a leader and the quorum).

        Raises ``TimeoutError`` with the member's log when it does not within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while True:
            if member.proc is not None and member.proc.poll() is not None:
                raise RuntimeError(f"etcd {member.name} exited with {member.proc.returncode}: {member.log()}")
            if self.healthy(member):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd {member.name} not healthy within {timeout:g} s: {member.log()}")
            time.sleep(0.05)

    def healthy(self, member: EtcdMember) -> bool:
        """True when ``member`` says it is healthy (a leader elected, the quorum there)."""
        context = None
        if self.client_tls is not None:
            ca, cert, key = self.client_tls
            context = ssl.create_default_context(cafile=str(ca))
            context.load_cert_chain(str(cert), str(key))
        try:
            with urllib.request.urlopen(
                f"{self.scheme}://{member.endpoint}/health", timeout=1, context=context
            ) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def leader_index(self) -> int:
        """The index of the member that is etcd's raft leader now.

        Killing the raft leader is not "nothing changes": a write proposed while the others elect a
        new one may be dropped and answered "request timed out" after etcd's request timeout
        (~6 s here). Tests of one lost member pick a follower unless that is their subject.
        """
        statuses = json.loads(self.etcdctl("endpoint", "status", "-w", "json"))
        endpoints = [m.endpoint for m in self.members if m.running]
        for endpoint, status in zip(endpoints, statuses, strict=True):
            if status["Status"]["header"]["member_id"] == status["Status"]["leader"]:
                return self.endpoints.index(endpoint)
        raise RuntimeError(f"no etcd member says it leads: {statuses}")

    def follower_index(self) -> int:
        """The index of a running member that is not the raft leader."""
        leader = self.leader_index()
        return next(i for i, m in enumerate(self.members) if m.running and i != leader)

    def _refuse_if_shared(self, what: str) -> None:
        if self.shared:
            raise RuntimeError(
                f"cannot {what}: this etcd cluster is shared by the module's tests (module_etcd_cluster); "
                "a test that kills, stops or restarts members takes the etcd_cluster fixture, its own cluster"
            )

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` and reap it."""
        self._refuse_if_shared(f"kill etcd member {index}")
        self._end(self.members[index], signal.SIGKILL)

    def stop(self, index: int) -> None:
        """SIGTERM member ``index`` (etcd's orderly stop) and reap it."""
        self._refuse_if_shared(f"stop etcd member {index}")
        self._end(self.members[index], signal.SIGTERM)

    def restart(self, index: int, *, wait: bool = True) -> None:
        """Start member ``index`` again on its data (it rejoins the cluster it was part of); with
        ``wait`` return once it answers healthy (which needs the quorum)."""
        self._refuse_if_shared(f"restart etcd member {index}")
        member = self.members[index]
        if member.running:
            raise RuntimeError(f"etcd {member.name} is still running; stop or kill it first")
        self._spawn(member, "existing")
        if wait:
            self.wait_member(member)

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        """Return once every running member answers healthy (e.g. after a raft leader was killed)."""
        for member in self.members:
            if member.running:
                self.wait_member(member, timeout)

    def lose_quorum(self) -> list[int]:
        """SIGKILL all but one member (two of three): the cluster can no longer commit anything.
        Returns the indexes killed, for :meth:`regain_quorum`."""
        stopped = list(range(1, self.size))
        for index in stopped:
            self.kill(index)
        return stopped

    def regain_quorum(self, stopped: Sequence[int]) -> None:
        """Restart the members :meth:`lose_quorum` stopped and wait until all are healthy."""
        for index in stopped:
            self.restart(index, wait=False)
        for member in self.members:
            self.wait_member(member)

    def _end(self, member: EtcdMember, sig: int) -> None:
        proc = member.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def close(self) -> None:
        """SIGKILL every member, wait for each (no process is left behind) and delete its data
        folder, keeping its log.

        etcd preallocates its write-ahead log: 64 MB for the segment in use and 64 MB for the next,
        so a closed three-member cluster would leave about 370 MB in the test's folder, which pytest
        keeps; the suite starts some thirty clusters, and a CI machine's disk filled up with them.
        """
        for member in self.members:
            self._end(member, signal.SIGKILL)
        for member in self.members:
            shutil.rmtree(member.data_dir, ignore_errors=True)

    # -- inspection ------------------------------------------------------------------------------

    def etcdctl(self, *args: str, timeout: float = 10.0) -> str:
        """Run ``etcdctl`` (API v3) against the running members; returns stdout, raises on failure."""
        endpoints = ",".join(m.endpoint for m in self.members if m.running)
        tls: list[str] = []
        if self.client_tls is not None:
            ca, cert, key = self.client_tls
            tls = ["--cacert", str(ca), "--cert", str(cert), "--key", str(key)]
        result = subprocess.run(
            ["etcdctl", "--endpoints", endpoints, *tls, "--command-timeout", f"{timeout:g}s", *args],
            capture_output=True,
            text=True,
            timeout=timeout + 5,
            env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    def get_json(self, key: str) -> dict[str, object]:
        """``etcdctl get KEY -w json``: the header and the kvs (keys and values base64)."""
        return dict(json.loads(self.etcdctl("get", key, "-w", "json")))


@contextlib.contextmanager
def running_cluster(
    root: Path,
    *,
    extra_hosts: Sequence[str] = (),
    enable_v2: bool = False,
    client_tls: tuple[Path, Path, Path] | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[EtcdCluster]:
    """A started :class:`EtcdCluster` in ``root``, closed on exit (benchmarks use this)."""
    cluster = EtcdCluster(
        root, extra_hosts=extra_hosts, enable_v2=enable_v2, client_tls=client_tls, extra_args=extra_args
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A fresh three-member etcd cluster on loopback for one test, which may kill its members;
    skipped without etcd."""
    if ETCD_MISSING:
        pytest.skip(ETCD_MISSING)
    with running_cluster(tmp_path / "etcd") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def module_etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One three-member etcd cluster shared by a module's tests, which keep their keys under
    :func:`etcd_prefix` and may not kill, stop or restart its members; skipped without etcd."""
    if ETCD_MISSING:
        pytest.skip(ETCD_MISSING)
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"), shared=True)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


_prefixes = itertools.count(1)


@pytest.fixture
def etcd_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix for this test alone on a shared cluster: ``tNNNNN-<test name>`` (the numbered
    head keeps any prefix from being the start of another one). Without a leading slash: the
    ``--store`` URL's path (``cluster.url(etcd_prefix)``); an ``EtcdStore`` takes ``"/" + it``."""
    name = re.sub(r"[^A-Za-z0-9._]", "_", request.node.name)[:100]
    return f"t{next(_prefixes):05d}-{name}"

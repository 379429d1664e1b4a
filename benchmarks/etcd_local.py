"""A local etcd for the benchmarks: one member, or a cluster of three, on loopback.

Debian's ``etcd-server`` package (3.4; ``/usr/bin/etcd``) is what runs; ``.ci/run`` installs it.
Each member gets free loopback ports and a data directory under the caller's work folder, and its
log goes there too. ``enable_v2`` turns on etcd's v2 API as well (what torch elastic's ``etcd-v2``
rendezvous backend speaks; sarcomm's store uses only v3, which is always on).

Use as a context manager::

    with LocalEtcd(workdir, members=3) as etcd:
        store = etcd.store_url("/sarcomm")     # etcd://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/sarcomm

Everything started is stopped on exit (SIGTERM, then SIGKILL after 5 s).
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ETCD_BINARY = "etcd"
LOOPBACK = "127.0.0.1"


def etcd_binary() -> str | None:
    """The etcd server's path, or None when it is not installed (``apt-get install etcd-server``)."""
    return shutil.which(ETCD_BINARY)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://{LOOPBACK}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{LOOPBACK}:{self.peer_port}"


class LocalEtcd:
    """``members`` etcd processes forming one cluster on loopback (1 or 3).

    Blocks in ``__enter__`` until every member answers ``/health`` (at most ``start_timeout`` s);
    raises RuntimeError naming the log when one does not, FileNotFoundError when etcd is not
    installed.
    """

    def __init__(
        self, workdir: Path, *, members: int = 1, enable_v2: bool = False, start_timeout: float = 30.0
    ) -> None:
        if members < 1:
            raise ValueError(f"members={members} must be >= 1")
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("etcd is not installed: apt-get install etcd-server (Debian's etcd 3.4)")
        self.binary = binary
        self.workdir = workdir
        self.enable_v2 = enable_v2
        self.start_timeout = start_timeout
        self.members = [_Member(f"m{i}", _free_port(), _free_port()) for i in range(members)]

    @property
    def endpoints(self) -> list[str]:
        """Every member's client address, ``HOST:PORT``."""
        return [f"{LOOPBACK}:{m.client_port}" for m in self.members]

    def store_url(self, prefix: str = "/sarcomm") -> str:
        """The ``--store`` value for sar-coordinator: ``etcd://H:P[,H:P...]PREFIX``."""
        return f"etcd://{','.join(self.endpoints)}{prefix}"

    def _start(self, member: _Member) -> None:
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        data = self.workdir / f"etcd-{member.name}"
        log = (self.workdir / f"etcd-{member.name}.log").open("ab")
        cmd = [
            self.binary, "--name", member.name, "--data-dir", str(data),
            "--listen-client-urls", member.client_url, "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", f"bench-{member.peer_port}", "--log-level", "warn",
            "--logger", "zap",
        ]  # fmt: skip
        if self.enable_v2:
            cmd.append("--enable-v2")
        # Its own session, so a terminal's Ctrl-C reaches it only through our clean-up.
        member.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def healthy(self, member: _Member) -> bool:
        try:
            with urllib.request.urlopen(f"{member.client_url}/health", timeout=1) as reply:
                return bool(json.loads(reply.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def __enter__(self) -> LocalEtcd:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for member in self.members:
                self._start(member)
            deadline = time.monotonic() + self.start_timeout
            for member in self.members:
                while not self.healthy(member):
                    assert member.proc is not None
                    if member.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"etcd member {member.name} did not become healthy within "
                            f"{self.start_timeout:g} s; see {self.workdir / f'etcd-{member.name}.log'}"
                        )
                    time.sleep(0.05)
        except BaseException:
            self.__exit__()
            raise
        return self

    def pids(self) -> list[int]:
        return [m.proc.pid for m in self.members if m.proc is not None]

    def __exit__(self, *exc: object) -> None:
        for member in self.members:
            if member.proc is not None and member.proc.poll() is None:
                member.proc.send_signal(signal.SIGTERM)
        for member in self.members:
            if member.proc is None:
                continue
            try:
                member.proc.wait(5)
            except subprocess.TimeoutExpired:
                member.proc.kill()
                member.proc.wait(5)

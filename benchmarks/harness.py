"""What every benchmark that runs a coordinator shares: ports, a ``sar-coordinator`` child process
(started, waited for, measured, stopped the same way), its CPU, memory and connections (counted),
py-spy around it, and the load generators' channels (one TCP connection each).

Benchmarks run as scripts (``python benchmarks/NAME.py``) and import this by its bare name, as they
import :mod:`recording`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

LOOPBACK = "127.0.0.1"
#: The `sar-coordinator` command as this interpreter runs it.
SAR_COORDINATOR: tuple[str, ...] = (sys.executable, "-m", "sarcomm.coordinator.cli")
#: The `sar-worker` command as this interpreter runs it.
SAR_WORKER: tuple[str, ...] = (sys.executable, "-m", "sarcomm.worker.agent.cli")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on now (the kernel's choice; taken again only by chance)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


#: The channel option that gives a channel its own subchannel pool. Without it gRPC's global pool
#: puts every channel of a process with equal arguments on one subchannel, so on one TCP
#: connection: a load generator's thousand "agents" were a handful of connections.
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)
#: The state column of /proc/net/tcp for an established connection.
_ESTABLISHED = "01"


def own_channel(target: str, options: Sequence[tuple[str, str | int]] = ()) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel on a TCP connection of its own, as a real agent's (with ``options``
    besides)."""
    return grpc.aio.insecure_channel(target, options=[OWN_CONNECTION, *options])


def connections(port: int, pid: int | None = None) -> int:
    """TCP connections established to local ``port`` (their server ends, as
    ``ss -tn state established '( sport = :PORT )'`` counts them, IPv4 and IPv6); with ``pid``,
    only those that process holds, so accepted, not waiting in the listener's queue."""
    sockets: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _ESTABLISHED and int(fields[1].rpartition(":")[2], 16) == port:
                sockets.add(fields[9])
    if pid is None:
        return len(sockets)
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:  # closed since the listing
            continue
        if link.startswith("socket:[") and link[8:-1] in sockets:
            held += 1
    return held


def process_cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds process ``pid`` has used so far, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    # utime and stime are fields 14 and 15 of stat(5); the split starts at field 3.
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has used so far (user + system, all threads)."""
    return sum(process_cpu_times(pid))


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak RSS) of process ``pid``, in KiB."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0])
    return found


class CoordinatorProcess:
    """A ``sar-coordinator`` child process on loopback; a context manager that waits until it
    serves Coordinator calls (on etcd: until it leads) and stops it on exit.

    ``state``: a SQLite file, or None for an in-memory state; ``store``: ``etcd://...`` instead.
    ``flags``: further ``sar-coordinator`` flags. ``cpus``: the CPUs it may run on (all when None).
    ``profile``: a py-spy raw profile to record while it serves. ``listen_host``: the gRPC
    listener's host (HTTP stays on loopback); ``env``: its whole environment (default: this one's).
    """

    def __init__(
        self,
        log_path: Path,
        *,
        state: Path | None = None,
        store: str | None = None,
        flags: Sequence[str] = (),
        log_level: str = "WARNING",
        cpus: set[int] | None = None,
        profile: Path | None = None,
        grpc_port: int | None = None,
        http_port: int | None = None,
        listen_host: str = LOOPBACK,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port()
        self.log_path = log_path
        self.store = store
        storage = ["--store", store] if store else ["--state", str(state)] if state is not None else []
        self.cmd = [
            *SAR_COORDINATOR,
            "--listen", f"{listen_host}:{self.grpc_port}",
            "--http", f"{LOOPBACK}:{self.http_port}",
            *storage, "--log-level", log_level, *flags,
        ]  # fmt: skip
        self.profile = profile
        self._cpus = cpus
        self._env = dict(env) if env is not None else None
        self._log = log_path.open("ab")
        self.proc = self._spawn()
        self._profiler: subprocess.Popen[bytes] | None = None

    def _spawn(self) -> subprocess.Popen[bytes]:
        cpus = self._cpus
        return subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self._env,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )

    @property
    def target(self) -> str:
        """Its gRPC address, ``HOST:PORT``."""
        return f"{LOOPBACK}:{self.grpc_port}"

    @property
    def http(self) -> str:
        """Its HTTP base URL."""
        return f"http://{LOOPBACK}:{self.http_port}"

    def get(self, path: str, timeout: float = 30.0) -> str:
        """The body of ``GET path`` from its HTTP endpoint."""
        with urllib.request.urlopen(f"{self.http}{path}", timeout=timeout) as response:
            return str(response.read().decode())

    def serving(self) -> bool:
        """Whether it answers Coordinator RPCs now (a coordinator on etcd only once it leads)."""
        with grpc.insecure_channel(self.target) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="sarcomm.v1.Coordinator"), timeout=1
                )
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def role(self) -> str:
        """``leader`` or ``standby`` as ``/healthz`` says (``down`` when it does not answer)."""
        try:
            return str(json.loads(self.get("/healthz", timeout=1)).get("role", "leader"))
        except (OSError, ValueError):
            return "down"

    def wait_serving(self, timeout: float = 30.0) -> None:
        """Block until it serves Coordinator calls; raises if it exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sar-coordinator exited with {self.proc.returncode}; see {self.log_path}")
            if self.role() == "leader" and self.serving():
                return
            time.sleep(0.05)
        raise TimeoutError(f"sar-coordinator did not serve within {timeout:g} s; see {self.log_path}")

    def cpu_seconds(self) -> float:
        """CPU seconds it has used so far (user + system, all threads)."""
        return process_cpu_seconds(self.proc.pid)

    def memory_kib(self) -> dict[str, int]:
        """Its ``VmRSS`` and ``VmHWM`` in KiB."""
        return memory_kib(self.proc.pid)

    def job_times(self, job: str, start_wall: float) -> tuple[float | None, float | None]:
        """Its own (first join, world formed) for ``job``, in seconds after ``start_wall``."""
        with grpc.insecure_channel(self.target) as channel:
            reply = pb_grpc.CoordinatorStub(channel).ListJobs(pb.ListJobsRequest(job=job), timeout=10)
        if not reply.jobs:
            return None, None
        status = reply.jobs[0]
        return status.created - start_wall, (status.formed - start_wall) if status.formed else None

    def restart(self) -> None:
        """Start it again with the same command (after :meth:`kill` or :meth:`stop`)."""
        self.proc = self._spawn()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL by default) and, for SIGKILL, reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sig == signal.SIGKILL:
                self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return int(self.proc.returncode)

    def __enter__(self) -> CoordinatorProcess:
        try:
            self.wait_serving()
        except BaseException:
            self.close()
            raise
        if self.profile is not None:
            # Attached once it serves, so start-up imports stay out of the profile; py-spy leaves
            # idle samples out by default, so the gaps between rounds do not count.
            self._profiler = subprocess.Popen(
                ["py-spy", "record", "--pid", str(self.proc.pid), "--rate", "250", "--format", "raw",
                 "--nonblocking", "--output", str(self.profile)],
                stdout=self._log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        return self

    def close(self) -> None:
        """Stop the profiler (it writes its output when interrupted) and the coordinator."""
        if self._profiler is not None:
            self._profiler.send_signal(signal.SIGINT)
            try:
                self._profiler.wait(30)
            except subprocess.TimeoutExpired:
                self._profiler.kill()
                self._profiler.wait(5)
            self._profiler = None
        self.stop()
        self._log.close()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

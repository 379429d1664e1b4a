"""A one-node Slurm cluster for the tests: munged, slurmctld and slurmd from Debian's packages,
configured in a temporary folder (nothing under /etc/slurm is touched), on ports of their own.

The node declares more CPUs than the machine has (``SlurmdParameters=config_overrides``), so a
job of several tasks runs on a 2-core machine; the tasks share the cores.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.helpers import WaitTimeout, free_port, wait_for

__all__ = ["SlurmCluster", "slurm_unavailable"]

#: Every wait for a daemon has this deadline.
START_DEADLINE_S = 30.0
#: CPUs the test node declares (tasks of a job share the machine's real cores).
NODE_CPUS = 8


def slurm_unavailable() -> str:
    """Why a Slurm cluster cannot be started here, or "" when it can."""
    if os.geteuid() != 0:
        return "needs root to run slurmctld, slurmd and munged"
    missing = [
        c
        for c in ("slurmctld", "slurmd", "munged", "munge", "srun", "sbatch", "sinfo")
        if not shutil.which(c)
    ]
    if missing:
        return (
            f"needs Slurm and MUNGE (Debian: apt-get install slurm-wlm munge); missing: {', '.join(missing)}"
        )
    if not Path("/etc/munge/munge.key").exists():
        return "needs a MUNGE key at /etc/munge/munge.key (the munge package creates one)"
    return ""


def _gone(path: Path) -> bool:
    return not path.exists()


class SlurmCluster:
    """``start()`` brings up the daemons; ``env`` is what a Slurm client command needs;
    ``stop()`` ends every daemon this object started (and only those)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.node = socket.gethostname()
        self.conf = directory / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[tuple[str, Path]] = []

    def _write_conf(self) -> None:
        d = self.directory
        for sub in ("state", "spool", "log", "run"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=sarcomm-test",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "AuthType=auth/munge",
                    "CryptoType=crypto/munge",
                    "MpiDefault=none",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"StateSaveLocation={d / 'state'}",
                    f"SlurmdSpoolDir={d / 'spool'}",
                    f"SlurmctldPidFile={d / 'run' / 'slurmctld.pid'}",
                    f"SlurmdPidFile={d / 'run' / 'slurmd.pid'}",
                    f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
                    "SlurmdParameters=config_overrides",
                    "SchedulerType=sched/builtin",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "ReturnToService=2",
                    "JobCompType=jobcomp/none",
                    "AccountingStorageType=accounting_storage/none",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} Sockets=1 "
                    f"CoresPerSocket={NODE_CPUS} ThreadsPerCore=1 RealMemory=2000 State=UNKNOWN",
                    f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _munge_answers(self) -> bool:
        encoded = subprocess.run(["munge", "-n"], capture_output=True, timeout=10, check=False)
        return encoded.returncode == 0

    def start(self) -> None:
        self._write_conf()
        if not self._munge_answers():
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            subprocess.run(["munged", "--force"], check=True, timeout=30, capture_output=True)
            self._wait("munged to answer", self._munge_answers)
        run = self.directory / "run"
        subprocess.run(["slurmctld", "-c", "-f", str(self.conf)], check=True, timeout=30, env=self.env)
        self._daemons.append(("slurmctld", run / "slurmctld.pid"))
        subprocess.run(["slurmd", "-f", str(self.conf)], check=True, timeout=30, env=self.env)
        self._daemons.append(("slurmd", run / "slurmd.pid"))
        self._wait("the Slurm node to be idle", self._node_idle)

    def _node_idle(self) -> bool:
        shown = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10, env=self.env, check=False
        )
        return shown.stdout.strip() == "idle"

    def _wait(self, what: str, check: Callable[[], bool]) -> None:
        wait_for(check, START_DEADLINE_S, what=lambda: f"{what}: {self.logs()}", interval=0.2)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted((self.directory / "log").glob("*.log"))
        )

    def stop(self) -> None:
        for _name, pid_file in reversed(self._daemons):
            try:
                pid = int(pid_file.read_text())
            except (OSError, ValueError):
                continue
            subprocess.run(["kill", str(pid)], check=False, timeout=10)
            proc = Path(f"/proc/{pid}")
            with contextlib.suppress(WaitTimeout):
                wait_for(
                    functools.partial(_gone, proc), START_DEADLINE_S, what=f"pid {pid} to exit", interval=0.1
                )
            if proc.exists():
                subprocess.run(["kill", "-9", str(pid)], check=False, timeout=10)
        self._daemons.clear()

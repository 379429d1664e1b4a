"""``sar-coordinator``'s etcd flags as a user meets them, in real processes on a real etcd:
``--leader-ttl`` is bounded when parsed, flags that only mean something with ``--store`` are
refused without it, and a leader election that ends on an error ends the coordinator, with one
line, instead of leaving a replica that can never lead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.etcd_cluster import EtcdCluster
from tests.helpers import free_port

# Every test runs sar-coordinator as a process (those on etcd are system tests by their fixture).
pytestmark = pytest.mark.integration

SCRIPTS = Path(__file__).parent / "scripts"
#: How long a coordinator that refuses its flags, or whose election fails, may take to exit.
EXIT_WITHIN_S = 60.0


def _coordinator(
    *args: str, env: dict[str, str] | None = None, script: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``sar-coordinator ARGS`` on free ports until it exits (at most EXIT_WITHIN_S)."""
    command = [str(script)] if script else ["-m", "sarcomm.coordinator.cli"]
    return subprocess.run(
        [
            sys.executable,
            *command,
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--http",
            f"127.0.0.1:{free_port()}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=EXIT_WITHIN_S,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.mark.parametrize("ttl", ["99999999999999999999", "10000000000", "3601", "0", "٣"])
def test_a_leader_ttl_out_of_bounds_is_refused_naming_the_bound(etcd_cluster: EtcdCluster, ttl: str) -> None:
    rule = (
        "must be a whole number of seconds in 1..3600 (how long a dead leader holds the jobs before a "
        "standby takes over; etcd leases count whole seconds), e.g. 5."
    )
    for args, env, named in (
        (["--store", etcd_cluster.url("ttl"), "--leader-ttl", ttl], {}, f"--leader-ttl {ttl!r}"),
        (["--store", etcd_cluster.url("ttl")], {"SARCOMM_LEADER_TTL": ttl}, f"SARCOMM_LEADER_TTL={ttl!r}"),
    ):
        done = _coordinator(*args, env=env)
        assert done.returncode == 2, done.stderr
        # One line naming where the value came from (the flag or its variable), the value and the rule.
        assert done.stderr.strip().splitlines() == [f"sar-coordinator: {named} {rule}"]


def test_the_help_says_the_bound_of_the_leader_ttl() -> None:
    done = _coordinator("--help")
    assert done.returncode == 0
    assert "whole seconds, 1 to 3600," in " ".join(done.stdout.split())


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--leader-ttl", "5"], {}, "--leader-ttl"),
        (["--advertise", "head1:50051"], {}, "--advertise"),
        ([], {"SARCOMM_LEADER_TTL": "5"}, "--leader-ttl"),
        (
            ["--leader-ttl", "5", "--advertise", "head1:50051", "--etcd-user", "u"],
            {},
            "--leader-ttl, --advertise, --etcd-user",
        ),
    ],
)
def test_etcd_flags_without_a_store_are_refused_with_one_line(
    args: list[str], env: dict[str, str], named: str
) -> None:
    done = _coordinator(*args, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"sar-coordinator: {named} configure(s) the etcd store, but no --store etcd://... was given; give "
        "--store, or leave them out"
    ]


@pytest.mark.parametrize(
    ("ttl", "cause"),
    [
        # What protobuf says of a number beyond int64, before etcd is even asked.
        (
            "99999999999999999999",
            "an unexpected error (ValueError: Value out of range: 99999999999999999999); please report it",
        ),
        # etcd's own maximum.
        (
            "10000000000",
            "refused to grant a lease: etcdserver: too large lease TTL, longer than the longest lease etcd "
            "grants; give a smaller --leader-ttl",
        ),
    ],
)
def test_a_leader_election_that_fails_ends_the_coordinator_with_one_line(
    etcd_cluster: EtcdCluster, ttl: str, cause: str
) -> None:
    done = _coordinator(
        "--store",
        etcd_cluster.url("fails"),
        "--leader-ttl",
        ttl,
        script=SCRIPTS / "unbounded_ttl_coordinator.py",
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("sar-coordinator: the leader election stopped: "), last
    assert cause in last
    assert last.endswith("; this coordinator could never lead")

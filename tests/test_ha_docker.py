"""Containers with high availability: docker-compose.yml with docker-compose.etcd.yml on top (a
three-member etcd cluster from Debian's etcd-server image, two coordinators on it, the workers
given both addresses).

Needs what tests/test_docker.py needs (a Docker engine, Compose, and the images that
``deploy/docker/build-images.sh --prometheus --etcd`` builds with no registry); skips saying why
otherwise. Four workers run ``examples/collectives_check.py`` (every value checked, a pause between
rounds so the job lasts); once every rank trains, the leading coordinator's container is killed
with ``docker kill``. The other coordinator takes over, the workers re-attach to it, every worker
exits 0 having checked every value, and the job ends FINISHED with generation 1 and no member
failed. The take-over time (the kill to the other replica's health SERVING) is printed.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, wait_for
from tests.test_docker import (  # noqa: F401  (compose is a fixture)
    BUILD_DEADLINE_S,
    BUILD_SCRIPT,
    COMPOSE_FILE,
    EXIT_CANNOT_BUILD,
    JOB_DEADLINE_S,
    POLL_S,
    ROOT,
    WORLD,
    assert_nothing_left,
    compose,
    docker,
    logs,
    project,
    run,
)

ETCD_COMPOSE_FILE = ROOT / "docker-compose.etcd.yml"
LEADER_TTL_S = 3
ROUNDS = 400
# Rounds take milliseconds; the pause makes the job last about ROUNDS x PAUSE_S = 40 s, long
# enough to kill the leader mid-job and for the other replica to take over.
PAUSE_S = 0.1
COMMAND = f"-- python examples/collectives_check.py --rounds {ROUNDS} --pause {PAUSE_S}"
# The kill to the standby leading: the TTL plus a second, with slack for containers on 2 busy cores.
TAKEOVER_DEADLINE_S = LEADER_TTL_S + 10.0

pytestmark = [pytest.mark.docker, pytest.mark.timeout(BUILD_DEADLINE_S + 600)]


@pytest.fixture(scope="module")
def ha_images(compose: list[str]) -> None:  # noqa: F811
    """The sarcomm, Prometheus and etcd images, built (or found in the cache) by build-images.sh."""
    started = time.monotonic()
    proc = run(["bash", str(BUILD_SCRIPT), "--prometheus", "--etcd"], timeout=BUILD_DEADLINE_S)
    output = (proc.stdout + proc.stderr)[-3000:]
    if proc.returncode == EXIT_CANNOT_BUILD:
        pytest.skip(f"the images cannot be built on this machine: {output.strip().splitlines()[-1]}")
    assert proc.returncode == 0, f"build-images.sh failed ({proc.returncode}):\n{output}"
    print(f"build-images.sh: {time.monotonic() - started:.0f} s\n{proc.stdout}")


def role(http_port: int) -> str | None:
    """What the coordinator published on ``http_port`` says it is (/healthz): leader, standby, or
    None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=2) as resp:
            return str(json.loads(resp.read()).get("role"))
    except (OSError, ValueError):
        return None


def jobs(http_port: int) -> dict[str, Any]:
    """The /v1/jobs of the coordinator published on ``http_port``, by job ({} when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/jobs", timeout=5) as resp:
            return {job["job"]: job for job in json.loads(resp.read())["jobs"]}
    except (OSError, ValueError):
        return {}


def test_compose_etcd_file_is_valid_over_the_base_file(compose: list[str]) -> None:  # noqa: F811
    """`config` accepts the two files: three etcd members, two coordinators on etcd, workers given both."""
    proc = run(
        [*compose, "--file", str(COMPOSE_FILE), "--file", str(ETCD_COMPOSE_FILE), "config"], timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for service in ("etcd1", "etcd2", "etcd3", "coordinator", "coordinator2", "worker"):
        assert re.search(rf"(?m)^  {service}:$", out), service
    assert "SARCOMM_COORD: coordinator:50051,coordinator2:50051" in out
    assert out.count("SARCOMM_STORE: etcd://etcd1:2379,etcd2:2379,etcd3:2379/sarcomm") == 2


def test_killing_the_leading_coordinators_container_mid_job_the_job_still_finishes_right(
    compose: list[str],  # noqa: F811
    ha_images: None,
    tmp_path: Path,
) -> None:
    job = "ha"
    http2, grpc2 = free_port(), free_port()
    extra = {
        "SARCOMM_HTTP_PORT2": str(http2), "SARCOMM_GRPC_PORT2": str(grpc2),
        "SARCOMM_LEADER_TTL": str(LEADER_TTL_S), "SARCOMM_ETCD_IMAGE": "sarcomm-etcd:local",
    }  # fmt: skip
    files = (COMPOSE_FILE, ETCD_COMPOSE_FILE)
    with project(compose, job, COMMAND, tmp_path, files, extra) as proj:
        ports = {"coordinator": proj.http_port, "coordinator2": http2}
        proc = proj.run(
            "up", "-d", "--scale", f"worker={WORLD}", "etcd1", "etcd2", "etcd3", "coordinator",
            "coordinator2", "worker", timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, f"compose up failed:\n{proc.stdout}{proc.stderr}"

        def training() -> dict[str, Any] | None:
            # Ask every replica: a standby's view is read from etcd, which holds no progress (the
            # reports stay in the leader's memory), so only the leader's view can say "training".
            for port in ports.values():
                found: dict[str, Any] | None = jobs(port).get(job)
                if found and found["state"] == "RUNNING":
                    seqs = [m.get("progress", {}).get("seq", 0) for m in found["members"]]
                    if len(seqs) == WORLD and min(seqs) > 10:
                        return found
            return None

        wait_for(training, JOB_DEADLINE_S, what=f"every rank of job {job} to be training", interval=POLL_S)
        roles = {service: role(port) for service, port in ports.items()}
        leaders = [s for s, r in roles.items() if r == "leader"]
        assert len(leaders) == 1, roles
        (leader,) = leaders
        (standby,) = [s for s in ports if s != leader]
        assert roles[standby] == "standby", roles
        (container,) = proj.containers(leader)
        killed_at = time.monotonic()
        docker("kill", container["Id"])
        wait_for(
            lambda: role(ports[standby]) == "leader",
            TAKEOVER_DEADLINE_S,
            what=f"{standby} to take over from {leader}",
            interval=0.1,
        )
        took = time.monotonic() - killed_at
        running = [w["Name"] for w in proj.workers() if w["State"]["Running"]]
        assert len(running) == WORLD, "the job ended before the standby took over: make it last longer"

        def ended() -> dict[str, Any] | None:
            found = jobs(ports[standby]).get(job)
            return found if found and found["state"] in ("FINISHED", "FAILED") else None

        result = wait_for(ended, JOB_DEADLINE_S, what=f"job {job} to end on {standby}", interval=POLL_S)

        def exited() -> list[dict[str, Any]] | None:
            found = proj.workers()
            return found if found and all(not w["State"]["Running"] for w in found) else None

        workers = wait_for(exited, 60, what="every worker container to exit", interval=POLL_S)
        assert {w["Name"]: w["State"]["ExitCode"] for w in workers} == {w["Name"]: 0 for w in workers}
        assert (result["state"], result["generation"], result["world_size"]) == ("FINISHED", 1, WORLD), result
        members = result["members"]
        assert sorted(m["rank"] for m in members) == list(range(WORLD))
        assert [(m["state"], m["exit_code"]) for m in members] == [("LEFT", 0)] * WORLD, members
        # Every rank checked every value of every round (collectives_check exits non-zero otherwise).
        checked = [
            line for w in workers for line in logs(w).splitlines() if f"correct in {ROUNDS} rounds" in line
        ]
        assert len(checked) == WORLD, [logs(w)[-2000:] for w in workers]
        print(f"docker kill of the leading coordinator ({leader}): {standby} led after {took:.1f} s")
        assert_nothing_left(proj)

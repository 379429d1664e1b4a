"""sar-worker under Slurm: ``srun sar-worker --coord HOST:PORT -- COMMAND`` with no other flag,
and the example batch script, on a real one-node Slurm cluster (slurmctld, slurmd, MUNGE)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.worker.agent.cli import parse
from tests.conftest import StartCoordinator
from tests.helpers import free_port, wait_for
from tests.slurm_cluster import SlurmCluster, slurm_unavailable

ROOT = Path(__file__).resolve().parent.parent
CHECK = str(ROOT / "examples" / "collectives_check.py")
JOB_DEADLINE_S = 180.0
TASKS = 4


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = slurm_unavailable()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def slurm_env(cluster: SlurmCluster) -> dict[str, str]:
    """The environment srun hands the tasks: this interpreter's commands first on PATH."""
    env = {k: v for k, v in cluster.env.items() if not k.startswith(("SARCOMM_", "SAR_", "SLURM_"))}
    env["SLURM_CONF"] = str(cluster.conf)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def test_srun_sar_worker_needs_no_flag_but_the_coordinator(
    slurm: SlurmCluster, start_coordinator: StartCoordinator
) -> None:
    coord = start_coordinator("--heartbeat-interval", "0.5")
    done = subprocess.run(
        ["srun", "--job-name", "gnn", f"--ntasks={TASKS}", "--nodes=1", "--kill-on-bad-exit=1",
         "sar-worker", "--coord", coord.grpc_target, "--backend", "gloo", "--socket-name", "lo",
         "--", sys.executable, CHECK],
        capture_output=True, text=True, timeout=JOB_DEADLINE_S, env=slurm_env(slurm), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # One world of TASKS ranks, ranks in Slurm's task order, every value checked by the ranks.
    lines = re.findall(rf"(?m)^\[rank (\d)\] rank (\d)/{TASKS} on .* correct in 3 rounds$", done.stdout)
    assert sorted(lines) == [(str(r), str(r)) for r in range(TASKS)], done.stdout
    jobs = coord.get_json("/v1/jobs")
    assert isinstance(jobs, dict)
    (job,) = jobs["jobs"]
    assert re.fullmatch(r"gnn-\d+", job["job"]), job["job"]
    assert (job["state"], job["world_size"], job["generation"]) == ("FINISHED", TASKS, 1)
    assert sorted(m["rank"] for m in job["members"]) == list(range(TASKS))
    assert {m["state"] for m in job["members"]} == {"LEFT"}


def test_each_rank_gets_slurms_local_rank_and_the_nodes_rank_count(
    slurm: SlurmCluster, start_coordinator: StartCoordinator
) -> None:
    coord = start_coordinator("--heartbeat-interval", "0.5")
    show = "import os; print(*(os.environ[v] for v in ('RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'SAR_JOB')))"
    done = subprocess.run(
        ["srun", "--job-name", "env", f"--ntasks={TASKS}", "--nodes=1", "sar-worker", "--coord",
         coord.grpc_target, "--output-tag", "", "--", sys.executable, "-c", show],
        capture_output=True, text=True, timeout=JOB_DEADLINE_S, env=slurm_env(slurm), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = sorted(line.split() for line in done.stdout.splitlines())
    # One node: the local ranks are the task ids, and all TASKS ranks share it.
    assert [row[:3] for row in rows] == [[str(r), str(r), str(TASKS)] for r in range(TASKS)]
    assert len({row[3] for row in rows}) == 1


def test_the_batch_script_starts_the_coordinator_and_one_agent_per_task(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    env = slurm_env(slurm)
    env.update({"SARCOMM_PORT": str(free_port()), "SARCOMM_HTTP_PORT": str(free_port()),
                "SARCOMM_STATE_DIR": str(tmp_path / "state"), "SARCOMM_BACKEND": "gloo",
                "SAR_SOCKET_NAME": "lo"})  # fmt: skip
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", f"--ntasks-per-node={TASKS}", f"--chdir={tmp_path}",
         str(ROOT / "examples" / "slurm" / "sarcomm.sbatch"), sys.executable, CHECK],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]

    def finished() -> str | None:
        shown = subprocess.run(
            ["scontrol", "show", "job", job_id],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
            check=False,
        ).stdout
        state = re.search(r"JobState=(\S+)", shown)
        return shown if state and state[1] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") else None

    shown = wait_for(finished, JOB_DEADLINE_S, what=f"Slurm job {job_id} to end", interval=0.5)
    output = (tmp_path / f"sarcomm-{job_id}.out").read_text()
    assert "JobState=COMPLETED" in shown, output + slurm.logs()
    assert "ExitCode=0:0" in shown
    assert len(re.findall(rf"(?m)^\[rank \d\] rank \d/{TASKS} on .* correct in 3 rounds$", output)) == TASKS
    # The coordinator the script started is gone with the job.
    log = (tmp_path / "state" / "coordinator.log").read_text()
    assert "coordinator stopped" in log, log


def test_flags_and_variables_win_over_slurm(tmp_path: Path) -> None:
    slurm_vars = {
        "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1", "SLURM_JOB_NAME": "my job!",
        "SLURM_JOB_ID": "77",
    }  # fmt: skip
    config, *_ = parse(["--coord", "h:1", "--", "x"], slurm_vars)
    assert (config.job, config.world_size, config.rank) == ("my-job-77", 4, 3)
    assert (config.local_rank, config.node_ranks, config.nproc_per_node) == (1, 2, 1)
    # Two local ranks per task: the world and the ranks scale with them.
    config, *_ = parse(["--coord", "h:1", "--nproc-per-node", "2", "--", "x"], slurm_vars)
    assert (config.world_size, config.rank, config.local_rank, config.node_ranks) == (8, 6, 2, 4)
    # The contract's flags and variables win; a world size of one's own lets the coordinator deal.
    config, *_ = parse(
        ["--coord", "h:1", "--job", "gnn", "--", "x"], {**slurm_vars, "SARCOMM_WORLD_SIZE": "8"}
    )
    assert (config.job, config.world_size, config.rank) == ("gnn", 8, None)
    # Outside an srun step (a batch script's own shell), Slurm says nothing.
    without_step = {k: v for k, v in slurm_vars.items() if k != "SLURM_STEP_ID"}
    with pytest.raises(InvalidArgumentError, match="--job is required"):
        parse(["--coord", "h:1", "--", "x"], without_step)

"""sar-worker under Slurm: ``srun sar-worker --coord HOST:PORT -- COMMAND`` with no other flag,
and the example batch script, on a real one-node Slurm cluster (slurmctld, slurmd, MUNGE)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.worker.agent.cli import parse
from tests.conftest import StartCoordinator
from tests.helpers import SAR_WORKER, free_port, wait_for
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


#: A task's variables as srun sets them: task 3 of 4, two per node, the second on node 1.
STEP = {
    "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_NODEID": "1", "SLURM_JOB_NAME": "gnn", "SLURM_JOB_ID": "77",
}  # fmt: skip
ALL_FLAGS = ["--coord", "h:1", "--job", "mine", "--world-size", "8", "--rank", "2", "--", "x"]


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x"},
         "SLURM_STEP_TASKS_PER_NODE='2(x' must be a list like '2(x3),1' (tasks per node)."),
        ({"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": "2(x"},
         "SLURM_TASKS_PER_NODE='2(x' must be a list like '2(x3),1' (tasks per node)."),
        ({"SLURM_NODEID": "2"},
         "SLURM_NODEID='2' must be an integer in 0..1 (SLURM_STEP_TASKS_PER_NODE lists 2 node(s))."),
        ({"SLURM_LOCALID": "2"},
         "SLURM_LOCALID='2' must be an integer in 0..1 (this node runs 2 task(s) of the step)."),
        ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' must be an integer in 0..3 (SLURM_STEP_NUM_TASKS=4)."),
        ({"SLURM_STEP_NUM_TASKS": None, "SLURM_NTASKS": "many"},
         "SLURM_NTASKS='many' must be an integer in 1..2147483647."),
    ],
    ids=["step-tasks-per-node", "job-tasks-per-node", "node-id", "local-id", "procid", "ntasks"],
)  # fmt: skip
def test_a_bad_slurm_variable_is_reported_under_its_own_name(
    variables: dict[str, str | None], message: str
) -> None:
    env = {**STEP, **variables}
    with pytest.raises(InvalidArgumentError) as caught:
        parse(["--coord", "h:1", "--", "x"], {k: v for k, v in env.items() if v is not None})
    assert str(caught.value) == message


@pytest.mark.parametrize(
    "variables",
    [{"SLURM_PROCID": "garbage"}, {"SLURM_STEP_NUM_TASKS": "x", "SLURM_NTASKS": "y", "SLURM_PROCID": "-1"},
     {"SLURM_STEP_NUM_TASKS": None, "SLURM_NTASKS": None}, {"SLURM_PROCID": "9"}],
    ids=["procid", "task-counts", "no-task-count", "procid-beyond-the-tasks"],
)  # fmt: skip
def test_flags_replace_slurm_variables_without_reading_them(variables: dict[str, str | None]) -> None:
    env = {k: v for k, v in {**STEP, **variables}.items() if v is not None}
    config, *_ = parse(ALL_FLAGS, env)
    assert (config.job, config.world_size, config.rank) == ("mine", 8, 2)
    # Where this task sits on its node: no flag says, so Slurm does.
    assert (config.local_rank, config.node_ranks) == (1, 2)
    # The same through the variables of the flags.
    config, *_ = parse(
        ["--coord", "h:1", "--", "x"],
        {**env, "SARCOMM_JOB": "mine", "SARCOMM_WORLD_SIZE": "8", "SARCOMM_RANK": "2"},
    )
    assert (config.job, config.world_size, config.rank) == ("mine", 8, 2)
    # A world size of one's own: the coordinator deals the ranks, SLURM_PROCID is not read either.
    config, *_ = parse(["--coord", "h:1", "--world-size", "8", "--", "x"], env)
    assert (config.world_size, config.rank) == (8, None)


def test_an_agent_whose_flags_replace_a_garbage_slurm_procid_runs_its_rank(
    start_coordinator: StartCoordinator,
) -> None:
    coord = start_coordinator("--heartbeat-interval", "0.5")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_", "SLURM_"))}
    env.update({**STEP, "SLURM_PROCID": "garbage", "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_NODEID": "0",
                "SLURM_LOCALID": "0"})  # fmt: skip
    done = subprocess.run(
        [*SAR_WORKER, "--coord", coord.grpc_target, "--job", "flags",
         "--world-size", "1", "--rank", "0", "--output-tag", "", "--", sys.executable, "-c",
         "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['SAR_JOB'])"],
        capture_output=True, text=True, timeout=JOB_DEADLINE_S, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "0 1 flags\n"

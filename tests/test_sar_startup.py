"""SAR-style start-up through the coordinator, and the parsing of every launcher's environment.

The integration test runs four plain Python processes that do what SAR's examples do with
``nfs_ip_init``; the unit tests pin :func:`parse_launch_env` and its error messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.common.messages import Assignment, JoinResult
from sarcomm.worker import launch_env
from sarcomm.worker.launch_env import LaunchEnv, RegistrationSettings, detect_launcher, parse_launch_env
from sarcomm.worker.library import registration, startup
from sarcomm.worker.library.startup import WorkerInfo
from tests.conftest import CoordinatorProcess

SCRIPTS = Path(__file__).parent / "scripts"
WORLD = 4
# Bounds the whole four-process run: imports of torch, rendezvous, two collectives.
RUN_DEADLINE_S = 120.0


def run_ranks(
    coord: CoordinatorProcess, job: str, out: Path, mode: str = "train", world: int = WORLD
) -> list[subprocess.CompletedProcess[str]]:
    env = {**os.environ, "SARCOMM_HEARTBEAT_INTERVAL": "0.25"}
    env.pop("SAR_SOCKET_NAME", None)
    script = str(SCRIPTS / "sar_startup_rank.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, mode, str(rank), str(world), coord.grpc_target, job, str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    results = []
    for proc in procs:
        try:
            stdout, _ = proc.communicate(timeout=RUN_DEADLINE_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"a rank did not finish within {RUN_DEADLINE_S} s; coordinator log:\n{coord.log()}")
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, ""))
    return results


def test_coord_ip_init_then_initialize_comms_like_sar(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    results = run_ranks(coordinator, "sar", tmp_path)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout}"
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    for rank, s in enumerate(seen):
        assert (s["rank"], s["world_size"], s["backend"]) == (rank, WORLD, "gloo")
        assert s["master_ip"] == "127.0.0.1"
        env = s["env"]
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["SAR_COORD"] == coordinator.grpc_target
        assert (env["SAR_JOB"], env["SAR_GENERATION"], env["SAR_SOCKET_NAME"]) == ("sar", "1", "lo")
        # sync_params: rank 0's parameters (all 1.0) everywhere.
        assert s["params"] == [[1.0] * 6, [1.0] * 2]
        # gather_grads: the sum of every rank's gradient, 1 + 2 + 3 + 4.
        assert s["grads"] == [[10.0] * 6, [10.0] * 2]
    assert len({s["env"]["MASTER_PORT"] for s in seen}) == 1
    # Every process reported Leave with code 0 at exit.
    jobs = {j["job"]: j for j in coordinator.get_json("/v1/jobs")["jobs"]}  # type: ignore[index]
    assert jobs["sar"]["state"] == "FINISHED"
    assert sorted(m["rank"] for m in jobs["sar"]["members"]) == list(range(WORLD))
    assert {m["state"] for m in jobs["sar"]["members"]} == {"LEFT"}


def test_a_dead_peer_makes_collectives_raise_peer_failed_error(
    coordinator: CoordinatorProcess, tmp_path: Path
) -> None:
    results = run_ranks(coordinator, "dies", tmp_path, mode="peer-dies", world=2)
    assert results[1].returncode == 3
    assert results[0].returncode == 0, results[0].stdout
    seen = json.loads((tmp_path / "rank0.json").read_text())
    # The dead process's heartbeat stream broke: judged after one 0.5 s interval, not the
    # backend's 300 s timeout (nor the 1.5 s of missed beats).
    assert seen["heard_after_s"] < 15.0
    error = seen["error"]
    assert (error["type"], error["rank"]) == ("PeerFailedError", 1)
    assert "rank 1 on host" in error["message"]
    assert "connection lost" in error["message"]
    jobs = {j["job"]: j for j in coordinator.get_json("/v1/jobs")["jobs"]}  # type: ignore[index]
    assert jobs["dies"]["state"] == "FAILED"


def test_coord_ip_init_rejects_a_rank_outside_the_world() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"^rank=4 must be an integer in 0\.\.world_size-1 \(world_size=4\)\.$"
    ):
        registration.coord_ip_init(4, "127.0.0.1:1", job="j", world_size=4)


# -- launcher detection and parsing ------------------------------------------------------------


def test_parse_reads_sar_worker_variables() -> None:
    env = {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500", "SAR_COORD": "head:50051", "SAR_JOB": "gnn", "SAR_GENERATION": "3",
        "SAR_BACKEND": "gloo", "SAR_RESTART_COUNT": "2", "SAR_MEMBER_ID": "ab",
    }  # fmt: skip
    assert parse_launch_env(env) == LaunchEnv(
        launcher="sar-worker", rank=5, world_size=8, local_rank=1, local_world_size=4,
        master_addr="10.0.0.1", master_port=29500, backend="gloo", generation=3, job="gnn",
        restart_count=2, coord="head:50051",
    )  # fmt: skip


def test_parse_reads_torchrun_variables() -> None:
    env = {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n0",
        "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "x",
    }  # fmt: skip
    assert parse_launch_env(env) == LaunchEnv("torchrun", 3, 4, 1, 2, "n0", 1234)


def test_parse_reads_hand_set_rank_and_world_size_as_alone_on_the_host() -> None:
    assert parse_launch_env({"RANK": "0", "WORLD_SIZE": "1"}) == LaunchEnv("env", 0, 1, 0, 1)


def test_parse_reads_open_mpi_variables() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }  # fmt: skip
    assert parse_launch_env(env) == LaunchEnv("openmpi", 6, 8, 2, 4)


def test_parse_reads_mpich_pmi_variables() -> None:
    env = {
        "PMI_RANK": "1",
        "PMI_SIZE": "2",
        "MPI_LOCALRANKID": "1",
        "MPI_LOCALNRANKS": "2",
        "MASTER_ADDR": "h",
    }
    assert parse_launch_env(env) == LaunchEnv("mpich", 1, 2, 1, 2, master_addr="h")


def test_parse_reads_slurm_variables_with_tasks_per_node_lists() -> None:
    env = {
        "SLURM_PROCID": "7", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "3(x2),1",
        "SLURM_NODEID": "2",
    }  # fmt: skip
    with pytest.raises(
        InvalidArgumentError, match=r"^SLURM_PROCID='7' must be an integer in 0\.\.SLURM_NTASKS-1"
    ):
        parse_launch_env(env)
    env["SLURM_PROCID"] = "6"
    assert parse_launch_env(env) == LaunchEnv("slurm", 6, 7, 0, 1)
    env.update(SLURM_PROCID="4", SLURM_LOCALID="1", SLURM_NODEID="1")
    assert parse_launch_env(env) == LaunchEnv("slurm", 4, 7, 1, 3)
    env["SLURM_NTASKS_PER_NODE"] = "2"
    assert parse_launch_env(env).local_world_size == 2


def test_detect_launcher_prefers_rank_over_mpi_and_slurm() -> None:
    assert detect_launcher({"RANK": "0", "SLURM_PROCID": "3", "OMPI_COMM_WORLD_RANK": "1"}) == "env"
    assert detect_launcher({"OMPI_COMM_WORLD_RANK": "1", "SLURM_PROCID": "3"}) == "openmpi"
    assert detect_launcher({"PMI_RANK": "1", "SLURM_PROCID": "3"}) == "mpich"
    assert detect_launcher({"SLURM_PROCID": "3"}) == "slurm"
    assert detect_launcher({}) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' must be an integer in 0..WORLD_SIZE-1 (WORLD_SIZE=4)."),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK='4' must be an integer in 0..WORLD_SIZE-1 (WORLD_SIZE=4)."),
        (
            {"RANK": "-1", "WORLD_SIZE": "4"},
            "RANK='-1' must be an integer in 0..WORLD_SIZE-1 (WORLD_SIZE=4).",
        ),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be an integer in 1..2147483647."),
        ({"RANK": "0"}, "WORLD_SIZE is not set although RANK is; a launcher sets both."),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "LOCAL_RANK='2' must be an integer in 0..LOCAL_WORLD_SIZE-1 (LOCAL_WORLD_SIZE=2).",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "5"},
            "LOCAL_WORLD_SIZE='5' must be an integer in 1..WORLD_SIZE (WORLD_SIZE=4).",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"},
            "LOCAL_WORLD_SIZE is not set although LOCAL_RANK is; set both (torchrun and sar-worker do).",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": "70000"},
            "MASTER_PORT='70000' must be an integer in 1..65535 (a TCP port).",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": " "},
            "MASTER_ADDR='' must be the host name or address of rank 0.",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "SAR_BACKEND": "tcp"},
            "SAR_BACKEND='tcp' must be one of auto, gloo, nccl, ccl, mpi, ucc.",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "SAR_GENERATION": "-2"},
            "SAR_GENERATION='-2' must be an integer >= 0.",
        ),
        (
            {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"},
            "OMPI_COMM_WORLD_RANK='2' must be an integer in 0..OMPI_COMM_WORLD_SIZE-1 "
            "(OMPI_COMM_WORLD_SIZE=2).",
        ),
        ({"PMI_RANK": "0", "PMI_SIZE": "two"}, "PMI_SIZE='two' must be an integer in 1..2147483647."),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2(x", "SLURM_NODEID": "0"},
            "SLURM_TASKS_PER_NODE='2(x' must be a list like '2(x3),1' (tasks per node).",
        ),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "0"},
            "SLURM_LOCALID is not set although SLURM_TASKS_PER_NODE says this host runs 2 ranks; set both.",
        ),
    ],
)
def test_parse_names_variable_value_and_rule(env: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse_launch_env(env)
    assert str(caught.value) == message


def test_parse_without_any_launcher_says_what_to_set() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^No launcher variables are set: RANK and WORLD_SIZE"):
        parse_launch_env({"PATH": "/bin"})


# -- init() without a coordinator --------------------------------------------------------------


def _launch(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in list(os.environ):
        if name.startswith(
            ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SAR_", "OMPI_", "PMI_", "MPI_", "SLURM_")
        ):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_init_returns_the_launchers_view_without_initialising(monkeypatch: pytest.MonkeyPatch) -> None:
    _launch(
        monkeypatch,
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
         "MASTER_PORT": "2", "SAR_JOB": "j", "SAR_GENERATION": "4", "SAR_BACKEND": "gloo"},
    )  # fmt: skip
    assert startup.init(initialize=False) == WorkerInfo(
        rank=1, world_size=2, local_rank=1, local_world_size=2, master_addr="h", master_port=2,
        backend="gloo", generation=4, job="j", restart_count=0,
    )  # fmt: skip


def test_init_under_mpi_without_master_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    _launch(monkeypatch, {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    with pytest.raises(
        InvalidArgumentError, match=r"^MASTER_ADDR and MASTER_PORT not set \(launcher: openmpi\)"
    ):
        startup.init(initialize=False)


def test_init_refuses_a_world_size_other_than_the_launchers(monkeypatch: pytest.MonkeyPatch) -> None:
    _launch(monkeypatch, {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "2"})
    with pytest.raises(InvalidArgumentError, match=r"world_size=3 does not match WORLD_SIZE=2"):
        startup.init(world_size=3, initialize=False)


def test_init_with_a_coordinator_needs_a_job_name(monkeypatch: pytest.MonkeyPatch) -> None:
    _launch(monkeypatch, {})
    with pytest.raises(InvalidArgumentError, match=r"needs a job name: pass job= or set SAR_JOB"):
        startup.init(coord="127.0.0.1:1", world_size=2, initialize=False)
    with pytest.raises(InvalidArgumentError, match=r"needs the world size"):
        startup.init(coord="127.0.0.1:1", job="j", initialize=False)


def test_init_judges_no_variable_it_does_not_use(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each setting is read when the call that needs it runs: without initialising, the timeouts of
    # initialize_comms are not read, and without a progress file neither is the stamp interval.
    _launch(
        monkeypatch,
        {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "2",
         "SAR_COLLECTIVE_TIMEOUT": "soon", "SAR_EXIT_TIMEOUT": "never"},
    )  # fmt: skip
    monkeypatch.setenv("SARCOMM_HEARTBEAT_INTERVAL", "often")
    assert startup.init(initialize=False).rank == 0


def test_registration_settings_let_arguments_win_without_reading_the_variables(tmp_path: Path) -> None:
    env = {"SARCOMM_HEARTBEAT_INTERVAL": "often", "SARCOMM_TOKEN_FILE": str(tmp_path / "missing")}
    assert launch_env.registration_settings(env, 2.0, "secret") == RegistrationSettings(
        interval=2.0, socket_name="", metrics_host="0.0.0.0", tls=None, token="secret"
    )
    with pytest.raises(
        InvalidArgumentError,
        match=r"^SARCOMM_HEARTBEAT_INTERVAL='often' must be a positive number of seconds, "
        r"at most 604800 \(a week\)\.$",
    ):
        launch_env.registration_settings(env, None, "secret")
    with pytest.raises(
        InvalidArgumentError, match=r"^SARCOMM_TOKEN_FILE '.*missing' must be a readable file: "
    ):
        launch_env.registration_settings(env, 2.0, None)
    (tmp_path / "token").write_text("t0k\n")
    env = {
        "SARCOMM_TOKEN_FILE": str(tmp_path / "token"),
        "SAR_SOCKET_NAME": " lo ",
        "SAR_METRICS_HOST": "127.0.0.1",
    }
    assert launch_env.registration_settings(env, None, None) == RegistrationSettings(
        interval=1.0, socket_name="lo", metrics_host="127.0.0.1", tls=None, token="t0k"
    )


def test_member_environment_is_what_the_launch_parser_reads_back() -> None:
    member = Assignment(
        rank=3, world_size=4, local_rank=1, local_world_size=2, master_addr="10.0.0.1", master_port=29500,
        interface="eth1", address="10.0.0.2", generation=3, member_id="m1", secret="s1", job="j",
        restart_count=0,
    )  # fmt: skip
    joined = JoinResult("j", 3, 4, "10.0.0.1", 29500, "eth1", "10.0.0.2", 2, (member,))
    env = launch_env.member_environment(joined, 0, "h:1", restart_count=2)
    assert env == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "SAR_COORD": "h:1", "SAR_JOB": "j",
        "SAR_GENERATION": "3", "SAR_SOCKET_NAME": "eth1", "SAR_MEMBER_ID": "m1", "SAR_MEMBER_SECRET": "s1",
        "SAR_RESTART_COUNT": "2",
    }  # fmt: skip
    assert parse_launch_env(env) == LaunchEnv(
        "sar-worker", 3, 4, 1, 2, "10.0.0.1", 29500, generation=3, job="j", restart_count=2, coord="h:1"
    )
    extras = launch_env.member_environment(joined, 0, "h:1", 2, backend="gloo", extra_ports_count=2)
    assert (extras["SAR_BACKEND"], extras["SAR_EXTRA_PORTS"]) == ("gloo", "29501,29502")
    assert parse_launch_env(extras).backend == "gloo"


def test_rank_identity_reads_what_is_written_and_never_fails() -> None:
    identity = launch_env.rank_identity({"RANK": "x", "SAR_COORD": "", "SAR_GENERATION": "?"})
    assert identity == launch_env.RankIdentity(
        rank="x", job="", generation="?", coord=None, member_id=None, master_addr=None
    )
    assert (identity.rank_label, launch_env.rank_identity({}).rank_label) == ("x", "?")


@pytest.mark.parametrize(
    ("env", "member", "port"),
    [
        ({}, False, None),  # a plain torchrun rank opts in with the variable
        ({}, True, 0),  # a coordinator member serves on any free port so /sd lists it
        ({"SAR_METRICS_PORT": "9100"}, False, 9100),
        ({"SAR_METRICS_PORT": "0"}, False, 0),
        ({"SAR_METRICS_PORT": "-1"}, True, None),
    ],
)
def test_metrics_port_setting_reads_sar_metrics_port(
    env: dict[str, str], member: bool, port: int | None
) -> None:
    assert launch_env.metrics_port_setting(env, member) == port


@pytest.mark.parametrize("value", ["abc", "65536", "-2", "1.5"])
def test_metrics_port_setting_names_the_variable_the_value_and_the_rule(value: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        launch_env.metrics_port_setting({"SAR_METRICS_PORT": value}, True)
    assert str(caught.value) == (
        f"SAR_METRICS_PORT='{value}' must be an integer in -1..65535 "
        "(0: any free port, -1: no metrics endpoint)."
    )

"""``sar-worker``'s command line and what it hands its ranks, without a process: flags and
``SARCOMM_*`` variables (the flag wins), one-line errors naming the flag or variable, the value and
the rule, the usage status, subcommands plugged in through the registry, and the rank environment
(the contract). The agent end to end: tests/test_agent_e2e.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.common.messages import Assignment, JoinResult
from sarcomm.worker.agent import cli
from sarcomm.worker.agent.config import AgentConfig, omp_threads, rank_environment

# -- command line ------------------------------------------------------------------------------


BASE = ["--coord", "head:50051", "--job", "gnn", "--world-size", "8"]


def test_parse_reads_flags_and_the_command_after_the_separator() -> None:
    config, subcommand, _, level = cli.parse(
        [*BASE, "--rank", "4", "--nproc-per-node", "4", "--backend", "gloo", "--socket-name", "eth1",
         "--max-restarts", "2", "--metrics-port", "9500", "--join-timeout", "30", "--heartbeat-interval",
         "0.5", "--", "python", "train.py", "--lr", "1"],
        {},
    )  # fmt: skip
    assert subcommand is None
    assert level == "INFO"
    assert config == AgentConfig(
        coord="head:50051", job="gnn", world_size=8, command=("python", "train.py", "--lr", "1"), rank=4,
        nproc_per_node=4, backend="gloo", socket_name="eth1", max_restarts=2, metrics_port=9500,
        join_timeout=30.0, heartbeat_interval=0.5,
    )  # fmt: skip
    assert config.ranks == [4, 5, 6, 7]


def test_parse_falls_back_to_sarcomm_variables_and_the_flag_wins() -> None:
    env = {
        "SARCOMM_COORD": "h:1", "SARCOMM_JOB": "j", "SARCOMM_WORLD_SIZE": "4", "SARCOMM_NPROC_PER_NODE": "2",
        "SARCOMM_BACKEND": "nccl", "SARCOMM_METRICS_PORT": "9000", "SAR_SOCKET_NAME": "ib0",
    }  # fmt: skip
    config, *_ = cli.parse(["--backend", "gloo", "--", "x"], env)
    assert (config.coord, config.job, config.world_size, config.nproc_per_node) == ("h:1", "j", 4, 2)
    assert (config.backend, config.metrics_port, config.socket_name) == ("gloo", 9000, "ib0")
    config, *_ = cli.parse(["--", "x"], {**env, "SARCOMM_SOCKET_NAME": "eth2"})
    assert config.socket_name == "eth2"
    config, *_ = cli.parse(["--socket-name", "eth3", "--", "x"], {**env, "SARCOMM_SOCKET_NAME": "eth2"})
    assert config.socket_name == "eth3"


BAD_SETTINGS: list[tuple[list[str], dict[str, str], str]] = [
    (["--job", "j", "--world-size", "2", "--", "x"], {}, "--coord is required (or set SARCOMM_COORD)."),
    (
        [*BASE[:4], "--world-size", "0", "--", "x"],
        {},
        "--world-size '0' must be an integer in 1..2147483647.",
    ),
    (
        [*BASE[:4], "--", "x"],
        {"SARCOMM_WORLD_SIZE": "many"},
        "SARCOMM_WORLD_SIZE='many' must be an integer in 1..2147483647.",
    ),
    (
        [*BASE, "--backend", "tcp", "--", "x"],
        {},
        "--backend 'tcp' must be one of auto, gloo, nccl, ccl, mpi, ucc.",
    ),
    (
        [*BASE, "--join-timeout", "-1", "--", "x"],
        {},
        "--join-timeout '-1' must be a positive number of seconds, at most 604800 (a week).",
    ),
    (
        [*BASE, "--metrics-port", "70000", "--", "x"],
        {},
        "--metrics-port '70000' must be an integer in -1..65535.",
    ),
    ([*BASE, "--nproc-per-node", "9", "--", "x"], {}, "--nproc-per-node 9 must be in 1..--world-size (8)."),
    (
        [*BASE, "--rank", "7", "--nproc-per-node", "2", "--", "x"],
        {},
        "--rank 7 must be in 0..6: the ranks 7..8 of this host's 2 local ranks must fit in --world-size 8.",
    ),
    (
        ["--coord", "head", *BASE[2:], "--", "x"],
        {},
        "--coord 'head' must be HOST:PORT with a port in 1..65535.",
    ),
    (
        BASE,
        {},
        "COMMAND is missing: put it after '--', e.g. sar-worker --coord head:50051 --job gnn "
        "--world-size 8 -- python train.py",
    ),
]


@pytest.mark.parametrize(("argv", "env", "message"), BAD_SETTINGS)
def test_parse_names_the_flag_or_variable_the_value_and_the_rule(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        cli.parse(argv, env)
    assert str(caught.value) == message


def test_main_returns_usage_status_for_bad_settings_without_exiting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main([*BASE, "--world-size", "x", "--", "true"]) == cli.EXIT_USAGE
    error = capsys.readouterr().err
    assert "sar-worker: error: --world-size 'x' must be an integer in 1..2147483647." in error
    assert cli.main(["--help"]) == 0


# -- elastic ranges (--world-size MIN:MAX) ------------------------------------------------------


ELASTIC = ["--coord", "127.0.0.1:1", "--job", "gnn"]


def test_parse_reads_an_elastic_range_and_its_last_call() -> None:
    config, *_ = cli.parse([*ELASTIC, "--world-size", "4:6", "--nproc-per-node", "2", "--", "x"], {})
    assert (config.elastic, config.min_world_size, config.world_size, config.world_text) == (
        True,
        4,
        6,
        "4:6",
    )
    assert config.last_call_timeout == 3.0  # torchrun's sarcomm plugin's default
    env = {"SARCOMM_WORLD_SIZE": "2:3", "SARCOMM_LAST_CALL_TIMEOUT": "0"}
    config, *_ = cli.parse([*ELASTIC, "--", "x"], env)
    assert (config.min_world_size, config.world_size, config.last_call_timeout) == (2, 3, 0.0)
    config, *_ = cli.parse([*ELASTIC, "--world-size", "5", "--", "x"], env)
    assert (config.elastic, config.min_world_size, config.world_size) == (False, None, 5)


BAD_RANGES: list[tuple[list[str], str]] = [
    (["--world-size", "3:2"],
     "--world-size '3:2': MIN 3 must be at most MAX 2: an elastic world has MIN to MAX ranks (e.g. 2:3)."),
    (["--world-size", "0:2"],
     "--world-size '0:2': MIN and MAX of an elastic world must be integers in 1..2147483647 (MIN:MAX "
     "ranks, e.g. 2:4)."),
    (["--world-size", "2:"],
     "--world-size '2:': MIN and MAX of an elastic world must be integers in 1..2147483647 (MIN:MAX "
     "ranks, e.g. 2:4)."),
    (["--world-size", "3:6", "--nproc-per-node", "2"],
     "--world-size 3:6 with --nproc-per-node 2: MIN and MAX count ranks and each agent brings its 2, so "
     "both must be multiples of 2 (e.g. --world-size 4:6)."),
    (["--world-size", "4:5", "--nproc-per-node", "2"],
     "--world-size 4:5 with --nproc-per-node 2: MIN and MAX count ranks and each agent brings its 2, so "
     "both must be multiples of 2 (e.g. --world-size 4:4)."),
    (["--world-size", "2:3", "--nproc-per-node", "4"], "--nproc-per-node 4 must be in 1..--world-size (3)."),
    (["--world-size", "2:4", "--rank", "0"],
     "--rank 0 cannot be used with --world-size 2:4: the coordinator deals the ranks of an elastic world; "
     "leave --rank out."),
    (["--world-size", "2:4", "--last-call-timeout", "-1"],
     "--last-call-timeout '-1' must be a number of seconds in 0..3600."),
    # The coordinator's bounds and the protocol's, checked here first: exit 2 naming the flag
    # (the Indexed Job's pod failure policy relies on it), not the coordinator's refusal.
    (["--world-size", "2:4", "--last-call-timeout", "1e9"],
     "--last-call-timeout '1e9' must be a number of seconds in 0..3600."),
    (["--world-size", "1:99999999999"],
     "--world-size '1:99999999999': MIN and MAX of an elastic world must be integers in 1..2147483647 "
     "(MIN:MAX ranks, e.g. 2:4)."),
    (["--world-size", "99999999999"], "--world-size '99999999999' must be an integer in 1..2147483647."),
    (["--world-size", "2:4", "--max-restarts", "99999999999"],
     "--max-restarts '99999999999' must be an integer in 0..1000000."),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), BAD_RANGES)
def test_main_refuses_a_bad_elastic_range_with_one_line_before_any_connection(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Nothing listens on 127.0.0.1:1: an agent that tried to connect would say so, and wait.
    assert cli.main([*ELASTIC, *flags, "--", "true"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == f"sar-worker: error: {message}\n"


def test_bench_refuses_an_elastic_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*ELASTIC, "--world-size", "2:4", "bench"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (
        "sar-worker: error: bench: --world-size 2:4 must be a fixed N: a benchmark measures one world, "
        "which an elastic job re-forms\n"
    )


def test_subcommands_plug_in_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[AgentConfig, object]] = []

    class Echo:
        name = "echo"
        help = "test subcommand"

        def add_arguments(self, parser: object) -> None:
            parser.add_argument("--times", type=int, default=1)  # type: ignore[attr-defined]

        def run(self, config: AgentConfig, args: object) -> int:
            ran.append((config, args.times))  # type: ignore[attr-defined]
            return 7

    monkeypatch.setattr(cli, "_SUBCOMMANDS", {})
    cli.register_subcommand(Echo())
    assert cli.main([*BASE, "echo", "--times", "3"]) == 7
    assert ran[0][0].job == "gnn"
    assert ran[0][1] == 3
    with pytest.raises(InvalidArgumentError, match="takes no COMMAND"):
        cli.parse([*BASE, "echo", "--", "x"], {})


# -- what the ranks get ---------------------------------------------------------------------


def test_rank_environment_holds_the_contract() -> None:
    config = AgentConfig(
        coord="h:1", job="j", world_size=4, command=("x",), nproc_per_node=2, metrics_port=9000
    )
    members = tuple(
        Assignment(rank=r, world_size=4, local_rank=i, local_world_size=2, master_addr="10.0.0.1",
                   master_port=29500, interface="eth1", address="10.0.0.2", generation=3, member_id=f"m{i}",
                   secret=f"s{i}", job="j", restart_count=0)
        for i, r in enumerate((2, 3))
    )  # fmt: skip
    joined = JoinResult("j", 3, 4, "10.0.0.1", 29500, "eth1", "10.0.0.2", 0, members)
    env = rank_environment(
        {"PATH": "/bin", "RANK": "old"}, config, joined, 1, restart_count=1, progress_file=Path("/p/r3")
    )
    expected = {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "SAR_COORD": "h:1", "SAR_JOB": "j",
        "SAR_GENERATION": "3", "SAR_BACKEND": "auto", "SAR_SOCKET_NAME": "eth1",
        "GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1", "TP_SOCKET_IFNAME": "eth1",
        "CCL_SOCKET_IFNAME": "eth1", "SAR_MEMBER_ID": "m1", "SAR_MEMBER_SECRET": "s1",
        "SAR_RESTART_COUNT": "1",
    }  # fmt: skip
    assert {k: env[k] for k in expected} == expected
    assert env["SAR_METRICS_PORT"] == "9001"
    assert env["SAR_PROGRESS_FILE"] == "/p/r3"
    assert env["SARCOMM_HEARTBEAT_INTERVAL"] == "1.0"
    assert env["PATH"] == "/bin"
    # Two local ranks share this host's CPUs; a user's own setting is kept.
    assert env["OMP_NUM_THREADS"] == str(omp_threads(2))
    assert omp_threads(2) == max(1, len(os.sched_getaffinity(0)) // 2)
    kept = rank_environment({"OMP_NUM_THREADS": "7"}, config, joined, 0, restart_count=0)
    assert kept["OMP_NUM_THREADS"] == "7"

"""``sar-worker``: run a command as the local ranks of a sarcomm job, or a subcommand.

::

    sar-worker --coord HOST:PORT --job NAME --world-size N|MIN:MAX [--rank R] [--nproc-per-node K]
               [--backend auto|gloo|nccl|ccl|mpi|ucc] [--socket-name IFACE] [--max-restarts M]
               [--metrics-port P] [--metrics-host HOST] [--extra-ports K] [--join-timeout S]
               [--heartbeat-interval S] [--token-file PATH] [--tls-ca PATH] [--tls-cert PATH --tls-key PATH]
               [--last-call-timeout S] -- COMMAND [ARGS...]
    sar-worker --coord ... --job ... --world-size N SUBCOMMAND [...]

Every flag falls back to ``SARCOMM_<FLAG>`` (``--world-size`` -> ``SARCOMM_WORLD_SIZE``); a flag on
the command line wins. ``--socket-name`` also falls back to ``SAR_SOCKET_NAME``, as SAR documents.

``--world-size MIN:MAX`` asks for an elastic world of MIN to MAX ranks (each agent brings its
``--nproc-per-node`` ranks): it forms at MAX at once, or with MIN or more once
``--last-call-timeout`` seconds pass without a new arrival, and re-forms, without counting a
restart, when an agent is lost or a new one waits (see :mod:`sarcomm.worker.agent.decisions`).

Subcommands (``bench``, ...) plug in through :func:`register_subcommand`: an object with ``name``,
``help``, ``add_arguments(parser)`` and ``run(config, args) -> int``, where ``config`` is the
:class:`~sarcomm.worker.agent.config.AgentConfig` built from the shared flags (without a command).

Only :func:`main` decides the exit status; only the ``__main__`` block exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from sarcomm.common.addresses import parse_targets, validate_target
from sarcomm.common.constants import (
    BACKENDS,
    DEFAULT_LAST_CALL_TIMEOUT,
    MAX_EXTRA_PORTS,
    MAX_LAST_CALL_TIMEOUT,
    MAX_RESTARTS,
    SOCKET_NAME_VARIABLE,
    TLS_CA_VARIABLE,
    TLS_CERT_VARIABLE,
    TLS_KEY_VARIABLE,
    TORCH_AUTOLOAD_VARIABLE,
)
from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.common.flags import (
    SECONDS_RULE,
    Option,
    add_options,
    integer,
    nonempty,
    resolve_all,
    seconds,
    seconds_up_to,
    switch,
)
from sarcomm.common.tls import TLS_FLAGS, ClientTls, read_token_file
from sarcomm.worker.agent import bench
from sarcomm.worker.agent.config import AgentConfig, WorldSize
from sarcomm.worker.agent.output import DEFAULT_OUTPUT_TAG, ConsoleLogHandler, Tee, check_log_dir
from sarcomm.worker.agent.runner import EXIT_COORDINATOR, EXIT_USAGE, run_agent
from sarcomm.worker.launch_env import SlurmTask, metrics_host, slurm_task

__all__ = [
    "EXIT_COORDINATOR",
    "EXIT_USAGE",
    "Subcommand",
    "build_parser",
    "main",
    "parse",
    "register_subcommand",
    "run_agent",
]

log = logging.getLogger("sarcomm.worker")


class Subcommand(Protocol):
    """What a ``sar-worker`` subcommand provides (``bench`` and later ones)."""

    name: str
    help: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the subcommand's own flags."""

    def run(self, config: AgentConfig, args: argparse.Namespace) -> int:
        """Run with the shared settings and the parsed flags; return the exit status."""


_SUBCOMMANDS: dict[str, Subcommand] = {}


def register_subcommand(command: Subcommand) -> None:
    """Make ``sar-worker ... <command.name> [...]`` available; a later registration replaces one."""
    _SUBCOMMANDS[command.name] = command


def _builtin_subcommands() -> None:
    """Register the subcommands that ship with sarcomm (``bench`` imports no torch: only its ranks
    do, in :mod:`sarcomm.worker.library.bench_rank`)."""
    register_subcommand(bench.COMMAND)


# -- flags ---------------------------------------------------------------------------------------


def _target(text: str) -> str:
    """One coordinator address, or a comma-separated list of replicas (given back without the
    spaces around its items). A single address's error is the option's rule, as it always was; a
    list's names the item (an :class:`InvalidArgumentError`, which
    :func:`~sarcomm.common.flags.resolve` passes on)."""
    if "," in text:
        return ",".join(parse_targets(text))
    try:
        return validate_target(text)
    except InvalidArgumentError as exc:
        raise ValueError from exc


def _backend(text: str) -> str:
    if text not in BACKENDS:
        raise ValueError
    return text


def _ip_or_empty(text: str) -> str:
    try:
        return metrics_host(text, "--metrics-host")
    except InvalidArgumentError as exc:
        raise ValueError from exc


_OPTIONS: tuple[Option, ...] = (
    Option("--coord", _target, "HOST:PORT with a port in 1..65535",
            "coordinator gRPC address, or its replicas' as HOST:PORT,HOST:PORT,...", metavar="HOST:PORT",
            required=True),
    Option("--job", nonempty, "a non-empty job name", "job name", metavar="NAME", required=True),
    Option("--world-size", WorldSize.parse, WorldSize.RULE, "ranks in the whole job, or MIN:MAX for an "
            "elastic world of MIN to MAX ranks that re-forms when agents come or go", metavar="N",
            required=True),
    Option("--rank", *integer(0), "global rank of local rank 0 (default: the coordinator deals "
            "contiguous ranks per host)", metavar="R"),
    Option("--nproc-per-node", *integer(1), "local ranks to run", default=1, metavar="K"),
    Option("--backend", _backend, f"one of {', '.join(BACKENDS)}", "torch.distributed backend",
            default="auto", metavar="{" + ",".join(BACKENDS) + "}"),
    Option("--socket-name", str.strip, "an interface name", "network interface the ranks use (default: "
            "the coordinator chooses)", default="", metavar="IFACE", also_env=(SOCKET_NAME_VARIABLE,)),
    Option("--max-restarts", *integer(0, MAX_RESTARTS), "times to rejoin and restart after a failure",
            default=0, metavar="M"),
    Option("--metrics-port", *integer(-1, 65535), "where the ranks serve /metrics: local rank i "
            "gets P+i; 0: any free port; -1: none", default=0, metavar="P"),
    Option("--metrics-host", _ip_or_empty, "an IP address of this host", "address the ranks serve "
            "/metrics on, e.g. 127.0.0.1 (default: every interface)", default="", metavar="HOST"),
    Option("--no-auto-metrics", switch, "a boolean word (1, true, yes, on or 0, false, no, off)",
            "no zero-code metrics in the ranks (SAR_AUTO_METRICS=0 for them): a rank whose script "
            "does not use sarcomm's library then serves no /metrics", default=False, is_switch=True),
    Option("--extra-ports", *integer(0, MAX_EXTRA_PORTS), "ports after the master port to reserve "
            "with it for SAR's sampling workers, given to the ranks as SAR_EXTRA_PORTS", default=0,
            metavar="K"),
    Option("--join-timeout", seconds, SECONDS_RULE, "seconds to wait for the "
            "world to form, reaching the coordinator included (default: the coordinator's "
            "--join-timeout)", metavar="S"),
    Option("--last-call-timeout", *seconds_up_to(MAX_LAST_CALL_TIMEOUT), "with --world-size "
            "MIN:MAX: once MIN ranks have joined, the world forms when this long passes without a new "
            "arrival", default=DEFAULT_LAST_CALL_TIMEOUT, metavar="S"),
    Option("--heartbeat-interval", seconds, SECONDS_RULE, "seconds between "
            "heartbeats; at most the coordinator's", default=1.0, metavar="S"),
    Option("--token-file", Path, "a path", "file holding the coordinator's bearer token",
            metavar="PATH"),
    # TLS to the coordinator; any of the three turns it on. The names mirror the coordinator's:
    # --tls-cert/--tls-key are this program's own certificate and key (for --tls-client-ca).
    Option("--tls-ca", Path, "a path", "PEM CA bundle that signed the coordinator's certificate "
            "(default with --tls-cert: the system's roots)", metavar="PATH"),
    Option("--tls-cert", Path, "a path", "this host's PEM certificate, for a coordinator that "
            "requires one (--tls-client-ca)", metavar="PATH"),
    Option("--tls-key", Path, "a path", "PEM private key of --tls-cert", metavar="PATH"),
    Option("--output-tag", str, "text with {rank} and {local_rank}", "what each console line of a "
            "rank starts with; '' for none", default=DEFAULT_OUTPUT_TAG, metavar="TAG"),
    Option("--log-dir", check_log_dir, "a folder", "also write each rank's stdout and stderr to "
            "DIR/JOB/GENERATION/rank-R.stdout and .stderr", metavar="DIR"),
    Option("--tee", Tee, "console, files or both", "where the ranks' output goes (default: both with "
            "--log-dir, else console)", metavar="{console,files,both}"),
    Option("--log-level", str.upper, "DEBUG, INFO, WARNING or ERROR", "log level", default="INFO"),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; every option is a string here and is converted by :func:`parse`."""
    parser = argparse.ArgumentParser(
        prog="sar-worker",
        description="Register this host's local ranks of a sarcomm job, run COMMAND once per local "
        "rank with RANK, WORLD_SIZE, MASTER_ADDR, ... set, and exit with its exit code.",
        epilog="Put the command after '--': sar-worker --coord head:50051 --job gnn --world-size 8 "
        "--nproc-per-node 4 -- python train.py",
    )
    add_options(parser, _OPTIONS)
    _builtin_subcommands()
    if _SUBCOMMANDS:
        commands = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
        for command in _SUBCOMMANDS.values():
            command.add_arguments(commands.add_parser(command.name, help=command.help))
    return parser


def parse(
    argv: Sequence[str], env: Mapping[str, str]
) -> tuple[AgentConfig, Subcommand | None, argparse.Namespace, str]:
    """Parse ``argv`` (without the program name) with ``env`` as the variables to fall back to.

    Returns the settings, the subcommand (None: run COMMAND), the parsed namespace and the log
    level.

    Raises:
        SystemExit: from argparse, for ``--help`` and malformed flags (status 0 or 2).
        InvalidArgumentError: a missing or invalid setting (the message names flag or variable,
            value and rule), a missing COMMAND, or a COMMAND together with a subcommand.
    """
    argv = list(argv)
    command: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    slurm = slurm_task(env)
    launcher = _slurm_settings(slurm, args, env) if slurm is not None else {}
    values = resolve_all(_OPTIONS, args, env, launcher)
    token_file: Path | None = values.pop("token_file")
    tls_paths: tuple[Path | None, ...] = tuple(values.pop(name) for name in ("tls_ca", "tls_cert", "tls_key"))
    # Each file named as the user gave it: the flag, or the variable it fell back to.
    ca_name, cert_name, key_name = (
        variable if getattr(args, dest) is None and env.get(variable) else flag
        for dest, flag, variable in zip(
            ("tls_ca", "tls_cert", "tls_key"),
            TLS_FLAGS,
            (TLS_CA_VARIABLE, TLS_CERT_VARIABLE, TLS_KEY_VARIABLE),
            strict=True,
        )
    )
    tls = (
        ClientTls(*tls_paths, names=(ca_name, cert_name, key_name))
        if any(p is not None for p in tls_paths)
        else None
    )
    log_level: str = values.pop("log_level")
    if log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise InvalidArgumentError(f"--log-level {shorten(log_level)} must be DEBUG, INFO, WARNING or ERROR.")
    token = read_token_file(token_file) if token_file is not None else None
    subcommand = _SUBCOMMANDS.get(getattr(args, "subcommand", None) or "")
    if subcommand is not None and command:
        raise InvalidArgumentError(f"the {subcommand.name} subcommand takes no COMMAND after '--'.")
    if subcommand is None and not command:
        raise InvalidArgumentError(
            "COMMAND is missing: put it after '--', e.g. sar-worker --coord head:50051 --job gnn "
            "--world-size 8 -- python train.py"
        )
    log_dir: Path | None = values.pop("log_dir")
    tee: Tee | None = values.pop("tee")
    world: WorldSize = values.pop("world_size")
    auto_metrics = not values.pop("no_auto_metrics")
    # Every other option's dest is the AgentConfig field of the same name.
    config = AgentConfig(
        command=tuple(command),
        token=token,
        tls=tls,
        log_dir=log_dir,
        tee=tee or (Tee.BOTH if log_dir is not None else Tee.CONSOLE),
        world_size=world.high,
        min_world_size=world.low if world.elastic else None,
        auto_metrics=auto_metrics,
        **values,
        **(_slurm_placement(slurm, values["nproc_per_node"]) if slurm is not None else {}),
    )
    return config, subcommand, args, log_level


def _slurm_settings(
    slurm: SlurmTask, args: argparse.Namespace, env: Mapping[str, str]
) -> dict[str, Callable[[], tuple[str, str]]]:
    """What Slurm says of the flags no flag or variable sets: the job name, the world size (the
    step's tasks times the local ranks per task) and, with that world size, this task's ranks.
    Each is read (and its variables checked) only when :func:`~sarcomm.common.flags.resolve` asks for it."""
    nproc_text = args.nproc_per_node or env.get("SARCOMM_NPROC_PER_NODE") or "1"
    try:
        nproc = max(1, int(nproc_text))
    except ValueError:
        nproc = 1  # resolve reports the bad value itself
    settings: dict[str, Callable[[], tuple[str, str]]] = {
        "job": lambda: ("SLURM_JOB_NAME/SLURM_JOB_ID", slurm.job),
        "world_size": lambda: (slurm.tasks_variable, str(slurm.tasks * nproc)),
    }
    if args.world_size is None and "SARCOMM_WORLD_SIZE" not in env:
        # Ranks follow Slurm's task order, as srun's own ranks (SLURM_PROCID) do.
        settings["rank"] = lambda: ("SLURM_PROCID", str(slurm.procid * nproc))
    return settings


def _slurm_placement(slurm: SlurmTask, nproc: int) -> dict[str, Any]:
    """This task's node-local ranks: its share of the node's tasks, ``nproc`` ranks each."""
    return {"local_rank": slurm.localid * nproc, "local_world_size": slurm.node_tasks * nproc}


def main(argv: list[str] | None = None) -> int:
    """Run ``sar-worker`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    The status is COMMAND's (see :mod:`sarcomm.worker.agent.decisions`), :data:`EXIT_USAGE` for bad
    settings, :data:`EXIT_COORDINATOR` when the coordinator refused or was unreachable, 130 after
    Ctrl-C before the ranks started.
    """
    try:
        config, subcommand, args, log_level = parse(sys.argv[1:] if argv is None else argv, os.environ)
    except SystemExit as exc:  # argparse: --help, or a malformed flag it already reported
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except InvalidArgumentError as exc:
        print(f"sar-worker: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=log_level,
        format="%(asctime)s %(levelname)s sar-worker[%(process)d] %(name)s: %(message)s",
        handlers=[ConsoleLogHandler()],
    )
    if subcommand is not None:
        return subcommand.run(config, args)
    if config.auto_metrics and os.environ.get(TORCH_AUTOLOAD_VARIABLE, "1") != "1":
        log.warning(
            "the ranks' zero-code metrics are off: %s=%s keeps torch from loading sarcomm's entry "
            "point (a rank that uses sarcomm's library still serves /metrics)",
            TORCH_AUTOLOAD_VARIABLE, os.environ[TORCH_AUTOLOAD_VARIABLE],
        )  # fmt: skip
    return run_agent(config)


if __name__ == "__main__":
    raise SystemExit(main())

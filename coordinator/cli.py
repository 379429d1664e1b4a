"""``sar-coordinator``: run the coordinator daemon, or ``status`` to look at one.

Every flag falls back to ``SARCOMM_<FLAG>`` (``--heartbeat-interval`` -> ``SARCOMM_HEARTBEAT_INTERVAL``);
a flag on the command line wins. Only :func:`main` exits the process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sarcomm import __version__
from sarcomm.common.errors import InvalidArgumentError, SarcommError
from sarcomm.common.tls import ClientTls, read_token_file
from sarcomm.coordinator import loop, status
from sarcomm.coordinator.config import CoordinatorConfig, Limits
from sarcomm.coordinator.server import serve
from sarcomm.coordinator.storage.etcd_config import DEFAULT_LEADER_TTL, EtcdSettings, read_password_file

log = logging.getLogger("sarcomm.coordinator")


def _env_name(flag: str) -> str:
    return "SARCOMM_" + flag.lstrip("-").replace("-", "_").upper()


def _add(
    parser: argparse.ArgumentParser,
    env: Mapping[str, str],
    flag: str,
    *,
    default: Any = None,
    type: Callable[[str], Any] = str,
    help: str,
    dest: str | None = None,
) -> None:
    """A flag whose default comes from ``SARCOMM_<FLAG>`` when that is set."""
    env_value = env.get(_env_name(flag))
    parser.add_argument(
        flag,
        dest=dest or flag.lstrip("-").replace("-", "_"),
        type=type,
        default=env_value if env_value is not None else default,
        help=f"{help} (env {_env_name(flag)}; default {default})",
    )


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sar-coordinator",
        description="Rendezvous, liveness and discovery for SAR-style distributed PyTorch jobs.",
    )
    parser.add_argument("--version", action="version", version=f"sarcomm {__version__}")
    _add(parser, env, "--listen", default="0.0.0.0:50051", help="gRPC address HOST:PORT")
    _add(
        parser,
        env,
        "--http",
        default="0.0.0.0:9400",
        help="HTTP address HOST:PORT for /metrics, /sd, /healthz, /v1/jobs",
    )
    _add(
        parser,
        env,
        "--state",
        type=Path,
        help="SQLite file for jobs, members and generations (in memory when not given)",
    )
    _add(
        parser,
        env,
        "--store",
        help="etcd://HOST:PORT[,HOST:PORT...][/PREFIX]: keep the state in etcd instead of --state, shared "
        "by several coordinators (one leads, the others stand by); needs sarcomm[etcd]",
    )
    _add(
        parser,
        env,
        "--leader-ttl",
        type=_whole_seconds,
        default=DEFAULT_LEADER_TTL,
        help="with --store: whole seconds a leader's etcd lease lives unrenewed (how long a dead leader "
        "holds the jobs before a standby takes over)",
    )
    _add(
        parser,
        env,
        "--advertise",
        default="",
        help="with --store: HOST:PORT clients reach this coordinator's gRPC at (default: --listen, a "
        "wildcard host replaced by this host's name)",
    )
    _add(
        parser, env, "--etcd-cacert", type=Path, help="PEM CA bundle that signed etcd's certificate (TLS on)"
    )
    _add(parser, env, "--etcd-cert", type=Path, help="PEM client certificate for etcd's --client-cert-auth")
    _add(parser, env, "--etcd-key", type=Path, help="PEM key for --etcd-cert")
    _add(parser, env, "--etcd-user", help="etcd user name (etcd auth), with --etcd-password-file")
    _add(parser, env, "--etcd-password-file", type=Path, help="file holding --etcd-user's password")
    _add(parser, env, "--heartbeat-interval", type=float, default=1.0, help="seconds between member reports")
    _add(
        parser,
        env,
        "--heartbeat-misses",
        type=int,
        default=3,
        help="missed reports after which a member is judged dead",
    )
    _add(
        parser,
        env,
        "--stall-threshold",
        type=float,
        default=30.0,
        help="seconds ranks wait in one collective before status names the ranks they wait for",
    )
    _add(
        parser,
        env,
        "--reconnect-grace",
        type=float,
        default=10.0,
        help="seconds members restored from --state get to reconnect before they are judged",
    )
    _add(
        parser,
        env,
        "--join-timeout",
        type=float,
        default=600.0,
        help="seconds a join waits for its world to form",
    )
    _add(
        parser,
        env,
        "--shutdown-grace",
        type=float,
        default=5.0,
        help="seconds in-flight calls get on SIGTERM/SIGINT",
    )
    _add(parser, env, "--token-file", type=Path, help="file holding the shared token clients must send")
    _add(parser, env, "--tls-cert", type=Path, help="PEM certificate for gRPC and HTTP")
    _add(parser, env, "--tls-key", type=Path, help="PEM private key for --tls-cert")
    _add(
        parser,
        env,
        "--tls-client-ca",
        type=Path,
        help="PEM CA bundle; clients must present a certificate it signed (mutual TLS)",
    )
    limits = Limits()
    for flag, default, meaning in (
        ("--max-message-bytes", limits.max_message_bytes, "largest gRPC request or answer, in bytes"),
        ("--max-world-size", limits.max_world_size, "members per job (the largest world_size of a join)"),
        ("--max-jobs", limits.max_jobs, "jobs forming or running at once"),
        ("--max-streams", limits.max_streams, "Heartbeat, Watch and other streams open at once"),
        ("--max-join-waiters", limits.max_join_waiters, "Join calls waiting for their world at once"),
        ("--max-ended-jobs", limits.max_ended_jobs, "finished or failed jobs kept in memory for status"),
    ):
        _add(parser, env, flag, type=int, default=default, help=f"limit: {meaning}")
    _add(parser, env, "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")

    commands = parser.add_subparsers(dest="command", metavar="{status}")
    status_parser = commands.add_parser("status", help="show jobs, members, health and progress")
    _add(
        status_parser,
        env,
        "--coord",
        default="127.0.0.1:50051",
        help="coordinator gRPC address HOST:PORT, or its replicas' as HOST:PORT,HOST:PORT,... "
        "(then each one's role is shown too)",
    )
    _add(status_parser, env, "--job", default="", help="only this job")
    # A client's TLS settings, named as sar-worker names them; the token is the top-level
    # --token-file (SARCOMM_TOKEN_FILE), the same file the coordinator reads.
    _add(
        status_parser,
        env,
        "--tls-ca",
        type=Path,
        dest="client_tls_ca",
        help="PEM CA bundle that signed the coordinator's certificate (turns TLS on)",
    )
    _add(
        status_parser,
        env,
        "--tls-cert",
        type=Path,
        dest="client_tls_cert",
        help="this client's PEM certificate, for a coordinator with --tls-client-ca",
    )
    _add(status_parser, env, "--tls-key", type=Path, dest="client_tls_key", help="PEM key for --tls-cert")
    status_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing = status_parser.add_mutually_exclusive_group()
    listing.add_argument(
        "--all",
        action="store_true",
        help=f"list every member (a job of more than {status.SUMMARY_MEMBERS} is summarised: members "
        "counted by state, the failed ones and the ranks others wait for listed)",
    )
    listing.add_argument(
        "--members",
        type=_ranks,
        default=(),
        metavar="RANKS",
        help="list these ranks, e.g. 0-15,100",
    )
    status_parser.add_argument(
        "--watch",
        type=_positive_seconds,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until interrupted",
    )
    return parser


def _whole_seconds(text: str) -> int:
    """argparse type of ``--leader-ttl``: a whole number of seconds >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a whole number of seconds >= 1 (etcd leases count whole seconds), e.g. 5"
        )
    return int(text)


def _ranks(text: str) -> tuple[tuple[int, int], ...]:
    """argparse type of ``status --members``: ranks and ranges, ``0-15,100``."""
    try:
        return status.parse_ranks(text)
    except InvalidArgumentError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_seconds(text: str) -> float:
    """argparse type of ``--watch``: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a positive number of seconds between refreshes (e.g. --watch 2)"
        )
    return value


def _etcd_settings(args: argparse.Namespace) -> EtcdSettings | None:
    if not args.store:
        given = [
            flag
            for flag, value in (
                ("--etcd-cacert", args.etcd_cacert),
                ("--etcd-cert", args.etcd_cert),
                ("--etcd-key", args.etcd_key),
                ("--etcd-user", args.etcd_user),
                ("--etcd-password-file", args.etcd_password_file),
            )
            if value is not None
        ]
        if given:
            raise InvalidArgumentError(
                f"{', '.join(given)} configure(s) the etcd store, but no --store etcd://... was given"
            )
        return None
    if (args.etcd_user is None) != (args.etcd_password_file is None):
        raise InvalidArgumentError("--etcd-user and --etcd-password-file must be given together")
    return EtcdSettings(
        url=args.store,
        leader_ttl=args.leader_ttl,
        cacert=args.etcd_cacert,
        cert=args.etcd_cert,
        key=args.etcd_key,
        user=args.etcd_user,
        password=read_password_file(args.etcd_password_file) if args.etcd_password_file else None,
    )


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    return CoordinatorConfig(
        store=_etcd_settings(args),
        advertise=args.advertise,
        listen=args.listen,
        http=args.http,
        state=args.state,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_misses=args.heartbeat_misses,
        stall_threshold=args.stall_threshold,
        reconnect_grace=args.reconnect_grace,
        join_timeout=args.join_timeout,
        shutdown_grace=args.shutdown_grace,
        token_file=args.token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        log_level=args.log_level.upper(),
        limits=Limits(
            max_world_size=args.max_world_size,
            max_jobs=args.max_jobs,
            max_message_bytes=args.max_message_bytes,
            max_streams=args.max_streams,
            max_join_waiters=args.max_join_waiters,
            max_ended_jobs=args.max_ended_jobs,
        ),
    )


def _client_tls(args: argparse.Namespace) -> ClientTls | None:
    if args.client_tls_ca is None and args.client_tls_cert is None and args.client_tls_key is None:
        return None
    return ClientTls(args.client_tls_ca, args.client_tls_cert, args.client_tls_key)


def _raise_open_file_limit() -> None:
    """Let the coordinator hold as many connections as the hard limit allows.

    Every member, stream and scrape is a socket, and the soft limit is often 1024: hitting it
    would refuse healthy clients while a flood of connections lasts.
    """
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


async def _status(args: argparse.Namespace) -> None:
    token = read_token_file(args.token_file) if args.token_file else None
    tls = _client_tls(args)
    while True:
        view = status.MemberView(every=args.all, ranks=args.members)
        roles, response = await status.fetch_status(args.coord, args.job, token=token, tls=tls, view=view)
        if args.json:
            text = status.render_json(response, roles)
        else:
            text = status.render(response)
            if roles:
                text = status.render_roles(roles) + "\n\n" + text
        if args.watch is None:
            print(text)
            return
        print("\033[2J\033[H" + text, flush=True)
        await asyncio.sleep(args.watch)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    parser = build_parser(env)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    level = str(args.log_level).upper()
    logging.basicConfig(
        level=level if isinstance(logging.getLevelName(level), int) else "INFO",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "status":
            loop.run(_status(args))
            return 0
        config = config_from_args(args)
        _raise_open_file_limit()
        loop.run(serve(config))
        return 0
    except SarcommError as error:
        print(f"sar-coordinator: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"sar-coordinator: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

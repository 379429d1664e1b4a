"""``sar-coordinator``: run the coordinator daemon, or ``status`` to look at one.

Every flag falls back to ``SARCOMM_<FLAG>`` (``--heartbeat-interval`` -> ``SARCOMM_HEARTBEAT_INTERVAL``);
a flag on the command line wins. Only :func:`main` exits the process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from sarcomm import __version__
from sarcomm.common.errors import CoordinatorFailedError, InvalidArgumentError, SarcommError
from sarcomm.common.flags import (
    NONNEGATIVE_SECONDS_RULE,
    SECONDS_RULE,
    Option,
    add_options,
    integer,
    nonempty,
    nonnegative_seconds,
    resolve_all,
    seconds,
    switch,
)
from sarcomm.common.tls import ClientTls, read_token_file
from sarcomm.coordinator import fdlimit, loop, status
from sarcomm.coordinator.config import MAX_ACCEPTORS, REPORT_POLICIES, CoordinatorConfig, Limits
from sarcomm.coordinator.server import serve
from sarcomm.coordinator.storage.etcd_config import (
    COMPACTION_RETENTION_RULE,
    DEFAULT_COMPACTION_RETENTION,
    DEFAULT_LEADER_TTL,
    LEADER_TTL_RULE,
    MAX_LEADER_TTL,
    EtcdSettings,
    compaction_retention_ok,
    read_password_file,
)

log = logging.getLogger("sarcomm.coordinator")


def _leader_ttl(text: str) -> int:
    """``--leader-ttl``: a whole number of seconds in 1..MAX_LEADER_TTL."""
    digits = text.strip()
    if not (digits.isascii() and digits.isdigit()) or not 1 <= int(digits) <= MAX_LEADER_TTL:
        raise ValueError
    return int(digits)


def _compaction_retention(text: str) -> float:
    """``--etcd-compaction-retention``: 0, or seconds in the rule's range."""
    value = float(text)
    if not compaction_retention_ok(value):
        raise ValueError
    return value


def _report_policy(text: str) -> str:
    """``--report-policy``: one of REPORT_POLICIES."""
    if text not in REPORT_POLICIES:
        raise ValueError
    return text


def _ranks(text: str) -> tuple[tuple[int, int], ...]:
    """``status --members``: ranks and ranges, ``0-15,100`` (its errors name the part at fault)."""
    return status.parse_ranks(text)


_LIMITS = Limits()

#: The daemon's flags (each also read from SARCOMM_<FLAG>; see sarcomm.common.flags).
SERVER_OPTIONS: tuple[Option, ...] = (
    Option("--listen", nonempty, "HOST:PORT", "gRPC address HOST:PORT", default="0.0.0.0:50051"),
    Option("--http", nonempty, "HOST:PORT", "HTTP address HOST:PORT for /metrics, /sd, /healthz, /v1/jobs",
           default="0.0.0.0:9400"),
    Option("--state", Path, "a path", "SQLite file for jobs, members and generations (in memory when not "
           "given)"),
    Option("--store", str, "etcd://HOST:PORT[,HOST:PORT...][/PREFIX]", "etcd://HOST:PORT[,HOST:PORT...]"
           "[/PREFIX]: keep the state in etcd instead of --state, shared by several coordinators (one "
           "leads, the others stand by); needs sarcomm[etcd]"),
    Option("--leader-ttl", _leader_ttl, LEADER_TTL_RULE.removeprefix("must be "),
           f"with --store: whole seconds, 1 to {MAX_LEADER_TTL}, a leader's etcd lease lives unrenewed (how "
           "long a dead leader holds the jobs before a standby takes over)",
           shown_default=str(DEFAULT_LEADER_TTL)),
    Option("--advertise", str, "HOST:PORT", "with --store: HOST:PORT clients reach this coordinator's gRPC "
           "at", default="", shown_default="--listen, a wildcard host replaced by this host's name"),
    Option("--etcd-compaction-retention", _compaction_retention,
           COMPACTION_RETENTION_RULE.removeprefix("must be "),
           "with --store: seconds of etcd's history the leader keeps; it compacts older revisions "
           "(compaction is etcd-wide: every user of the same etcd loses them too); 0: leave it to etcd's "
           "--auto-compaction-retention", shown_default=f"{DEFAULT_COMPACTION_RETENTION:g}"),
    Option("--etcd-cacert", Path, "a path", "PEM CA bundle that signed etcd's certificate (TLS on)"),
    Option("--etcd-cert", Path, "a path", "PEM client certificate for etcd's --client-cert-auth"),
    Option("--etcd-key", Path, "a path", "PEM key for --etcd-cert"),
    Option("--etcd-user", str, "a user name", "etcd user name (etcd auth), with --etcd-password-file"),
    Option("--etcd-password-file", Path, "a path", "file holding --etcd-user's password"),
    Option("--heartbeat-interval", seconds, SECONDS_RULE, "seconds between member reports", default=1.0),
    Option("--heartbeat-misses", *integer(1), "missed reports after which a member is judged dead",
           default=3),
    Option("--stall-threshold", seconds, SECONDS_RULE, "seconds ranks wait in one collective before status "
           "names the ranks they wait for", default=30.0),
    Option("--reconnect-grace", nonnegative_seconds, NONNEGATIVE_SECONDS_RULE, "seconds members restored "
           "from --state get to reconnect before they are judged", default=10.0),
    Option("--join-timeout", seconds, SECONDS_RULE, "seconds a join waits for its world to form",
           default=600.0),
    Option("--shutdown-grace", nonnegative_seconds, NONNEGATIVE_SECONDS_RULE, "seconds in-flight calls get "
           "on SIGTERM/SIGINT", default=5.0),
    Option("--acceptors", *integer(1, MAX_ACCEPTORS), "gRPC servers sharing --listen's port, each taking new "
           "calls: 8 for jobs of thousands of agents, whose Joins and streams arrive at once", default=1),
    Option("--report-policy", _report_policy, "exception or per-second", "exception: offer each agent "
           "reports by exception (it reports only what changed and renews a lease; its open connection "
           "proves it alive, see docs/failures.md); per-second: never offer it, every reporter reports "
           "every member each --heartbeat-interval (the default for now: docs/failures.md says why)",
           default="per-second"),
    Option("--token-file", Path, "a path", "file holding the shared token clients must send"),
    Option("--tls-cert", Path, "a path", "PEM certificate for gRPC and HTTP"),
    Option("--tls-key", Path, "a path", "PEM private key for --tls-cert"),
    Option("--tls-client-ca", Path, "a path", "PEM CA bundle; clients must present a certificate it signed "
           "(mutual TLS)"),
    Option("--max-message-bytes", *integer(1), "limit: largest gRPC request or answer, in bytes",
           default=_LIMITS.max_message_bytes),
    Option("--max-world-size", *integer(1), "limit: members per job (the largest world_size of a join)",
           default=_LIMITS.max_world_size),
    Option("--max-jobs", *integer(1), "limit: jobs forming or running at once", default=_LIMITS.max_jobs),
    Option("--max-streams", *integer(1), "limit: Heartbeat, Watch and other streams open at once",
           default=_LIMITS.max_streams),
    Option("--max-join-waiters", *integer(1), "limit: Join calls waiting for their world at once",
           default=_LIMITS.max_join_waiters),
    Option("--max-ended-jobs", *integer(1), "limit: finished or failed jobs kept in memory for status",
           default=_LIMITS.max_ended_jobs),
    Option("--log-level", str.upper, "DEBUG, INFO, WARNING or ERROR", "DEBUG, INFO, WARNING or ERROR",
           default="INFO"),
)  # fmt: skip

#: ``status``'s own flags. A client's TLS settings are named as sar-worker names them; the token is
#: the top-level --token-file (SARCOMM_TOKEN_FILE), the same file the coordinator reads.
STATUS_OPTIONS: tuple[Option, ...] = (
    Option("--coord", nonempty, "HOST:PORT or HOST:PORT,HOST:PORT,...", "coordinator gRPC address "
           "HOST:PORT, or its replicas' as HOST:PORT,HOST:PORT,... (then each one's role is shown too)",
           default="127.0.0.1:50051"),
    Option("--job", str, "a job name", "only this job", default=""),
    Option("--tls-ca", Path, "a path", "PEM CA bundle that signed the coordinator's certificate (turns TLS "
           "on)", dest_name="client_tls_ca"),
    Option("--tls-cert", Path, "a path", "this client's PEM certificate, for a coordinator with "
           "--tls-client-ca", dest_name="client_tls_cert"),
    Option("--tls-key", Path, "a path", "PEM key for --tls-cert", dest_name="client_tls_key"),
    Option("--all", switch, "a boolean word (1, true, yes, on or 0, false, no, off)",
           f"list every member (a job of more than {status.SUMMARY_MEMBERS} is summarised: members counted "
           "by state, the failed ones and the ranks others wait for listed)", default=False, is_switch=True),
    Option("--members", _ranks, "ranks and ranges, e.g. 0-15,100", "list these ranks, e.g. 0-15,100",
           default=(), metavar="RANKS"),
    Option("--json", switch, "a boolean word (1, true, yes, on or 0, false, no, off)",
           "print JSON instead of a table", default=False, is_switch=True),
    Option("--watch", seconds, f"{SECONDS_RULE} between refreshes (e.g. --watch 2)",
           "refresh every SECONDS until interrupted", metavar="SECONDS", const="2",
           shown_default="no refresh; 2 with --watch alone"),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: every option a plain string, converted by :func:`parse_args`."""
    parser = argparse.ArgumentParser(
        prog="sar-coordinator",
        description="Rendezvous, liveness and discovery for SAR-style distributed PyTorch jobs.",
    )
    parser.add_argument("--version", action="version", version=f"sarcomm {__version__}")
    add_options(parser, SERVER_OPTIONS)
    commands = parser.add_subparsers(dest="command", metavar="{status}")
    status_parser = commands.add_parser("status", help="show jobs, members, health and progress")
    add_options(status_parser, STATUS_OPTIONS)
    return parser


def parse_args(argv: Sequence[str] | None, env: Mapping[str, str]) -> argparse.Namespace:
    """``argv`` parsed and every option resolved (flag, then ``SARCOMM_<FLAG>`` in ``env``, then
    the default) and converted.

    Raises:
        SystemExit: from argparse, for ``--help`` and malformed flags (status 0 or 2).
        InvalidArgumentError: a value against its rule, naming the flag or variable.
    """
    args = build_parser().parse_args(argv)
    options = SERVER_OPTIONS + (STATUS_OPTIONS if args.command == "status" else ())
    for dest, value in resolve_all(options, args, env).items():
        setattr(args, dest, value)
    if args.command == "status" and args.all and args.members:
        raise InvalidArgumentError("status --all and --members RANKS ask for different lists: give one")
    return args


def _etcd_settings(args: argparse.Namespace) -> EtcdSettings | None:
    if not args.store:
        given = [
            flag
            for flag, value in (
                ("--leader-ttl", args.leader_ttl),
                ("--etcd-compaction-retention", args.etcd_compaction_retention),
                ("--advertise", args.advertise or None),
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
                f"{', '.join(given)} configure(s) the etcd store, but no --store etcd://... was given; "
                "give --store, or leave them out"
            )
        return None
    if (args.etcd_user is None) != (args.etcd_password_file is None):
        raise InvalidArgumentError("--etcd-user and --etcd-password-file must be given together")
    return EtcdSettings(
        url=args.store,
        leader_ttl=DEFAULT_LEADER_TTL if args.leader_ttl is None else args.leader_ttl,
        cacert=args.etcd_cacert,
        cert=args.etcd_cert,
        key=args.etcd_key,
        user=args.etcd_user,
        password=read_password_file(args.etcd_password_file) if args.etcd_password_file else None,
        compaction_retention=(
            DEFAULT_COMPACTION_RETENTION
            if args.etcd_compaction_retention is None
            else args.etcd_compaction_retention
        ),
    )


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    return CoordinatorConfig(
        store=_etcd_settings(args),
        advertise=args.advertise or "",
        listen=args.listen,
        http=args.http,
        state=args.state,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_misses=args.heartbeat_misses,
        stall_threshold=args.stall_threshold,
        reconnect_grace=args.reconnect_grace,
        join_timeout=args.join_timeout,
        shutdown_grace=args.shutdown_grace,
        acceptors=args.acceptors,
        report_policy=args.report_policy,
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
    try:
        args = parse_args(argv, env)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except SarcommError as error:
        print(f"sar-coordinator: {error}", file=sys.stderr)
        return 2
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
        fdlimit.raise_open_file_limit()
        loop.run(serve(config))
        return 0
    except CoordinatorFailedError as error:
        print(f"sar-coordinator: {error}", file=sys.stderr)
        return 1
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

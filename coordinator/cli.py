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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sarcomm import __version__
from sarcomm.coordinator import loop, status
from sarcomm.coordinator.config import CoordinatorConfig
from sarcomm.coordinator.errors import SarcommError

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
) -> None:
    """A flag whose default comes from ``SARCOMM_<FLAG>`` when that is set."""
    env_value = env.get(_env_name(flag))
    parser.add_argument(
        flag,
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
    _add(parser, env, "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")

    commands = parser.add_subparsers(dest="command", metavar="{status}")
    status_parser = commands.add_parser("status", help="show jobs, members, health and progress")
    _add(status_parser, env, "--coord", default="127.0.0.1:50051", help="coordinator gRPC address HOST:PORT")
    _add(status_parser, env, "--job", default="", help="only this job")
    status_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status_parser.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until interrupted",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    return CoordinatorConfig(
        listen=args.listen,
        http=args.http,
        state=args.state,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_misses=args.heartbeat_misses,
        join_timeout=args.join_timeout,
        shutdown_grace=args.shutdown_grace,
        token_file=args.token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        log_level=args.log_level.upper(),
    )


async def _status(args: argparse.Namespace) -> None:
    while True:
        response = await status.fetch_jobs(args.coord, args.job)
        text = status.render_json(response) if args.json else status.render(response)
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
        from sarcomm.coordinator.server import serve

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

"""The container health check of the sarcomm image: exit 0 when healthy, 1 when not.

    python /opt/sarcomm/healthcheck.py [HOST:PORT]

With HOST:PORT it asks that coordinator's ``grpc.health.v1.Health/Check`` for the service
``sarcomm.v1.Coordinator`` and is healthy only on SERVING (a coordinator shutting down answers
NOT_SERVING). Without, it looks at what the container runs: a ``sar-coordinator`` there is checked
the same way on its ``--listen`` port (``SARCOMM_LISTEN``, default 50051, on loopback when it listens
on every address); a ``sar-worker`` is healthy while it runs (a worker's health is the coordinator's
business: it watches heartbeats, and the agent exits when its job fails).

A coordinator on an etcd store (``--store etcd://...``, one of several replicas) is healthy while
the server as a whole serves (the service ``""``), leading or standing by: a standby answers
NOT_SERVING for ``sarcomm.v1.Coordinator`` by design, and is what takes over when the leader dies;
one shutting down answers NOT_SERVING for both.

The health service needs no token. When the coordinator serves TLS (``--tls-cert``), the check
trusts ``SARCOMM_HEALTHCHECK_CA`` or else that certificate, and sends ``SARCOMM_HEALTHCHECK_CERT``
and ``SARCOMM_HEALTHCHECK_KEY`` as its client certificate when set (``--tls-client-ca``);
``SARCOMM_HEALTHCHECK_NAME`` overrides the name checked against the certificate.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SERVICE = "sarcomm.v1.Coordinator"
DEFAULT_PORT = "50051"
TIMEOUT_S = 4.0


def processes() -> list[tuple[list[str], dict[str, str]]]:
    """(argv, environment) of every process of this container that this user may read."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or entry.name == str(os.getpid()):
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            raw = (entry / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw if "=" in item)
        found.append((argv, env))
    return found


def flag(argv: list[str], env: dict[str, str], name: str) -> str | None:
    """A coordinator flag's value as the coordinator reads it: ``--name V``, ``--name=V``, else
    ``SARCOMM_NAME``."""
    option = f"--{name}"
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(option + "="):
            return arg[len(option) + 1 :]
    return env.get("SARCOMM_" + name.upper().replace("-", "_"))


def local_target(listen: str) -> str:
    """Where to reach a coordinator listening on ``listen`` from inside its own container."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::", "*"):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check(target: str, tls_cert: str | None = None, service: str = SERVICE) -> int:
    """Ask ``target``'s health service about ``service``; 0 on SERVING, else 1 with a line on stderr."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options: list[tuple[str, str]] = []
    if tls_cert is not None:
        root = Path(os.environ.get("SARCOMM_HEALTHCHECK_CA", tls_cert)).read_bytes()
        cert, key = os.environ.get("SARCOMM_HEALTHCHECK_CERT"), os.environ.get("SARCOMM_HEALTHCHECK_KEY")
        credentials = grpc.ssl_channel_credentials(
            root_certificates=root,
            private_key=Path(key).read_bytes() if key and cert else None,
            certificate_chain=Path(cert).read_bytes() if key and cert else None,
        )
        if "SARCOMM_HEALTHCHECK_NAME" in os.environ:
            options.append(("grpc.ssl_target_name_override", os.environ["SARCOMM_HEALTHCHECK_NAME"]))
        channel = grpc.secure_channel(target, credentials, options=options)
    else:
        channel = grpc.insecure_channel(target)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        print(f"unhealthy: {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    name = service or "the server"
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"unhealthy: {target}: {name} is {status}", file=sys.stderr)
        return 1
    print(f"healthy: {target}: {name} is {status}")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        return check(argv[1], os.environ.get("SARCOMM_TLS_CERT"))
    running = processes()
    for args, env in running:
        if any(Path(arg).name == "sar-coordinator" for arg in args[:2]):
            if "status" in args[1:]:
                continue
            listen = flag(args, env, "listen") or f"0.0.0.0:{DEFAULT_PORT}"
            replica = (flag(args, env, "store") or "").startswith("etcd://")
            return check(local_target(listen), flag(args, env, "tls-cert"), "" if replica else SERVICE)
    if any(Path(arg).name == "sar-worker" for args, _ in running for arg in args[:2]):
        print("healthy: sar-worker is running")
        return 0
    print("unhealthy: neither sar-coordinator nor sar-worker runs in this container", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

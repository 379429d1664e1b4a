"""Issue 7 end to end: token, member secrets, TLS and mutual TLS, limits, undecodable requests.

Every refusal is checked twice: its status (and a message that names the field, the value and the
rule, or says which side rejected what), and that the coordinator's state did not change.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.errors import CoordinatorUnavailableError, UnauthenticatedError
from sarcomm.common.messages import MemberReport
from sarcomm.common.tls import ClientTls
from sarcomm.coordinator import cli as coordinator_cli
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from sarcomm.worker.launch_env import client_tls_setting
from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.helpers import LO, LO_PB, SAR_WORKER, wait_for_async
from tests.tls_files import TlsFiles, make_tls_files

TOKEN = "tok-7f3a9c1e5b2d4f60-secret"
# A TLS refusal must be reported within seconds, not at the join's deadline.
TLS_VERDICT_S = 15.0
# A long heartbeat interval: members of these tests never report unless a test says so.
QUIET = ("--heartbeat-interval", "60")


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def bearer(token: str = TOKEN) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def join_request(job: str, host: str, world_size: int = 2, **kw: Any) -> pb.JoinRequest:
    return pb.JoinRequest(
        job=job, world_size=world_size, host=host, interfaces=[LO_PB], store_port=29500, **kw
    )


async def form(stub: pb_grpc.CoordinatorAsyncStub, job: str, metadata: Any = None) -> list[pb.Assignment]:
    answers = await asyncio.gather(
        *(stub.Join(join_request(job, f"h{i}"), timeout=10, metadata=metadata) for i in range(2))
    )
    return [a for answer in answers for a in answer.assignments]


async def snapshot(stub: pb_grpc.CoordinatorAsyncStub, metadata: Any = None) -> list[str]:
    response = await stub.ListJobs(pb.ListJobsRequest(), timeout=5, metadata=metadata)
    return [str(job) for job in response.jobs]


async def code_of(call: Any) -> tuple[grpc.StatusCode, str]:
    """The status a call ends with (OK when it answered)."""
    try:
        result = await call
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


async def stream_code(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        async for _ in call:
            break
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    finally:
        call.cancel()
    return grpc.StatusCode.OK, ""


def http_get(
    coord: CoordinatorProcess, path: str, token: str | None = None, context: ssl.SSLContext | None = None
) -> tuple[int, str]:
    request = urllib.request.Request(f"{coord.http_url}{path}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5, context=context or coord.http_ssl) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture
async def channel_to() -> AsyncIterator[Callable[[CoordinatorProcess], grpc.aio.Channel]]:
    channels: list[grpc.aio.Channel] = []

    def open_channel(coord: CoordinatorProcess) -> grpc.aio.Channel:
        channels.append(grpc.aio.insecure_channel(coord.grpc_target))
        return channels[-1]

    yield open_channel
    for channel in channels:
        await channel.close(None)


# -- the shared token --------------------------------------------------------------------------


async def test_no_or_wrong_token_is_refused_everywhere_changes_nothing_and_never_leaks(
    start_coordinator: StartCoordinator,
    token_file: Path,
    channel_to: Callable[[CoordinatorProcess], grpc.aio.Channel],
) -> None:
    coord = start_coordinator(*QUIET, "--token-file", str(token_file), "--log-level", "DEBUG")
    channel = channel_to(coord)
    stub = pb_grpc.CoordinatorStub(channel)
    members = await form(stub, "held", bearer())
    before = await snapshot(stub, bearer())
    member = members[0]
    guesses = [(), bearer("guess-0d9e8f7a"), bearer(TOKEN + "x"), (("authorization", TOKEN),)]
    details = set()
    for metadata in guesses:
        calls = [
            stub.Join(join_request("intruder", "evil", world_size=1), timeout=5, metadata=metadata),
            stub.Leave(
                pb.LeaveRequest(member_id=member.member_id, secret=member.secret, exit_code=1),
                timeout=5,
                metadata=metadata,
            ),
            stub.ListJobs(pb.ListJobsRequest(), timeout=5, metadata=metadata),
        ]
        for call in calls:
            code, detail = await code_of(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED
            details.add(detail)
        # No request is written: the refusal comes before the coordinator reads one, and a
        # write racing that refusal fails inside the client (INTERNAL) rather than here.
        for call in (
            stub.Heartbeat(None, timeout=5, metadata=metadata),
            stub.Watch(pb.WatchRequest(job="held"), timeout=5, metadata=metadata),
            reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                timeout=5, metadata=metadata
            ),
        ):
            code, detail = await stream_code(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (detail, metadata)
            details.add(detail)
    # One message for every refusal: it says nothing about what exists.
    assert details == {"the call carries no valid token (send 'authorization: Bearer <token>')"}
    assert await snapshot(stub, bearer()) == before
    # Health answers without the token (container checks carry none); it reveals nothing.
    health = health_pb2_grpc.HealthStub(channel)
    assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == 1

    # HTTP: everything but /metrics and /healthz needs the token, unknown paths included, and the
    # refusal is the same whatever the path.
    refusals = {
        http_get(coord, p, t) for p in ("/sd", "/v1/jobs", "/v1/jobs?job=held", "/nope") for t in (None, "x")
    }
    assert refusals == {(401, json.dumps({"error": "unauthenticated"}))}
    assert http_get(coord, "/metrics")[0] == 200
    assert http_get(coord, "/healthz")[0] == 200
    assert http_get(coord, "/nope", TOKEN)[0] == 404
    status, jobs_body = http_get(coord, "/v1/jobs", TOKEN)
    assert status == 200
    assert '"held"' in jobs_body
    sd_body = http_get(coord, "/sd", TOKEN)[1]

    # Tokens and member secrets never leave: not in logs, errors, /v1/jobs, /sd or metrics.
    for m in members:
        await stub.Leave(
            pb.LeaveRequest(member_id=m.member_id, secret=m.secret, exit_code=0), timeout=5, metadata=bearer()
        )
    leaked = [coord.log_path.read_text(), jobs_body, sd_body, http_get(coord, "/metrics")[1], *details]
    for secret in (TOKEN, "guess-0d9e8f7a", *(m.secret for m in members)):
        assert not any(secret in text for text in leaked), secret


# -- member secrets ----------------------------------------------------------------------------


async def test_another_members_secret_is_refused_and_a_refused_request_changes_nothing(
    start_coordinator: StartCoordinator, channel_to: Callable[[CoordinatorProcess], grpc.aio.Channel]
) -> None:
    coord = start_coordinator(*QUIET)
    channel = channel_to(coord)
    stub = pb_grpc.CoordinatorStub(channel)
    a = await form(stub, "a")
    b = await form(stub, "b")
    before = await snapshot(stub)

    def report(member: pb.Assignment, secret: str | None = None, **kw: Any) -> pb.MemberReport:
        return pb.MemberReport(member_id=member.member_id, secret=secret or member.secret, **kw)

    for member_id, secret in (
        (a[0].member_id, a[1].secret),
        (a[0].member_id, b[0].secret),
        (b[1].member_id, ""),
    ):
        code, _ = await code_of(
            stub.Leave(pb.LeaveRequest(member_id=member_id, secret=secret, exit_code=3), timeout=5)
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED
    refused = [
        ([report(a[0], b[0].secret)], grpc.StatusCode.UNAUTHENTICATED),
        # A valid report beside one that is not: the whole request is refused, nothing recorded.
        (
            [report(a[1], metrics_address="127.0.0.1:9100"), report(a[0], a[1].secret)],
            grpc.StatusCode.UNAUTHENTICATED,
        ),
        # (A bad metrics endpoint or progress costs only that field: test_worker_endpoints.)
    ]
    for reports, expected in refused:
        call = stub.Heartbeat(iter([pb.HeartbeatRequest(reports=reports)]), timeout=5)
        assert (await stream_code(call))[0] == expected
    assert await snapshot(stub) == before
    # The members themselves still can.
    left = await stub.Leave(pb.LeaveRequest(member_id=a[0].member_id, secret=a[0].secret), timeout=5)
    assert left.job_state == "RUNNING"


# -- TLS ---------------------------------------------------------------------------------------


async def test_a_job_forms_and_finishes_over_tls_and_refusals_name_the_side(
    start_coordinator: StartCoordinator, tls_files: TlsFiles, token_file: Path
) -> None:
    http_ssl = tls_files.http_context(cert=False)
    coord = start_coordinator(
        *QUIET, *tls_files.server_args(), "--token-file", str(token_file), http_ssl=http_ssl
    )
    tls = tls_files.client(cert=False)
    async with CoordinatorClient(coord.grpc_target, TOKEN, tls=tls, timeout=10) as client:
        members = await asyncio.wait_for(
            asyncio.gather(*(client.join("secure", 2, host=f"h{i}", interfaces=[LO]) for i in range(2))), 15
        )
        reply = await client.heartbeat([MemberReport(m.member_id, m.secret) for m in members])
        assert reply.unknown_members == ()
        states = [await client.leave(m.member_id, m.secret, 0) for m in members]
    assert states[-1] == "FINISHED"
    # HTTPS with the token; `sar-coordinator status` as a TLS client.
    assert '"FINISHED"' in http_get(coord, "/v1/jobs", TOKEN)[1]
    status = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "sarcomm.coordinator.cli", "--token-file", str(token_file), "status",
         "--coord", coord.grpc_target, "--tls-ca", str(tls_files.ca)],
        capture_output=True, text=True, timeout=30, env=_clean_env(),
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert "job secure" in status.stdout
    assert "FINISHED" in status.stdout

    # A plaintext client: told the coordinator speaks TLS, in seconds though its join may wait 300 s.
    started = time.monotonic()
    async with CoordinatorClient(coord.grpc_target, TOKEN, timeout=10) as plain:
        with pytest.raises(
            CoordinatorUnavailableError, match=r"it speaks TLS and this client connected in plaintext"
        ):
            await plain.join("secure2", 1, interfaces=[LO], join_timeout=300)
    assert time.monotonic() - started < TLS_VERDICT_S
    # A client that does not trust the coordinator's CA says that it rejected the certificate.
    rogue = ClientTls(tls_files.rogue_ca)
    started = time.monotonic()
    async with CoordinatorClient(coord.grpc_target, TOKEN, tls=rogue, timeout=10) as distrustful:
        with pytest.raises(UnauthenticatedError, match=r"this client rejected the coordinator's certificate"):
            await distrustful.join("secure2", 1, interfaces=[LO], join_timeout=300)
    assert time.monotonic() - started < TLS_VERDICT_S
    # Other calls wait out their own (here short) deadline, then say the same.
    async with CoordinatorClient(coord.grpc_target, TOKEN, tls=rogue, timeout=1) as distrustful:
        with pytest.raises(UnauthenticatedError, match=r"this client rejected the coordinator's certificate"):
            await distrustful.list_jobs()
    # A TLS client of a plaintext coordinator.
    plain_coord = start_coordinator(*QUIET)
    async with CoordinatorClient(plain_coord.grpc_target, tls=tls, timeout=5) as confused:
        with pytest.raises(CoordinatorUnavailableError, match=r"it does not speak TLS"):
            await confused.join("x", 1, interfaces=[LO], join_timeout=300)


async def test_mutual_tls_admits_signed_clients_only_on_grpc_http_and_sar_worker(
    start_coordinator: StartCoordinator, tls_files: TlsFiles, token_file: Path, tmp_path: Path
) -> None:
    coord = start_coordinator(
        *QUIET, *tls_files.server_args(mutual=True), "--token-file", str(token_file),
        http_ssl=tls_files.http_context(),
    )  # fmt: skip
    async with CoordinatorClient(coord.grpc_target, TOKEN, tls=tls_files.client(), timeout=10) as client:
        member = await asyncio.wait_for(client.join("mutual", 1, interfaces=[LO]), 15)
        assert await client.leave(member.member_id, member.secret, 0) == "FINISHED"
    refusals = [
        (tls_files.client(cert=False), r"this client sent no certificate and the coordinator requires one"),
        (
            ClientTls(tls_files.ca, tls_files.rogue_cert, tls_files.rogue_key),
            r"the coordinator rejected this client's certificate '.*rogue\.pem': it must be signed by a CA "
            r"in the coordinator's --tls-client-ca",
        ),
    ]
    for tls, message in refusals:
        started = time.monotonic()
        async with CoordinatorClient(coord.grpc_target, TOKEN, tls=tls, timeout=10) as refused:
            with pytest.raises(UnauthenticatedError, match=message):
                await refused.join("mutual", 1, interfaces=[LO], join_timeout=300)
        assert time.monotonic() - started < TLS_VERDICT_S
    # HTTP side: the same rule.
    assert http_get(coord, "/healthz")[0] == 200
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        http_get(coord, "/healthz", context=tls_files.http_context(cert=False))

    # sar-worker: the options and the variables, and the message when the certificate is wrong.
    command = [sys.executable, "-c", "import os, sys; sys.exit(0 if os.environ['RANK'] == '0' else 5)"]
    base = ["--coord", coord.grpc_target, "--job", "agent", "--world-size", "1", "--join-timeout", "300"]
    ok = await _sar_worker(
        [*base, "--token-file", str(token_file), "--tls-ca", str(tls_files.ca), "--", *command],
        {"SARCOMM_TLS_CERT": str(tls_files.client_cert), "SARCOMM_TLS_KEY": str(tls_files.client_key)},
    )
    assert ok.returncode == 0, ok.stderr
    bad = await _sar_worker(
        [*base, "--token-file", str(token_file), "--tls-ca", str(tls_files.ca), "--tls-cert",
         str(tls_files.rogue_cert), "--tls-key", str(tls_files.rogue_key), "--", *command],
        {},
    )  # fmt: skip
    assert bad.returncode == 1
    assert "the coordinator rejected this client's certificate" in bad.stderr
    missing_key = await _sar_worker([*base, "--tls-cert", str(tls_files.client_cert), "--", *command], {})
    assert missing_key.returncode == 2
    assert "--tls-cert" in missing_key.stderr
    assert "must be given together" in missing_key.stderr


@pytest.mark.integration  # sar-coordinator processes
def test_unusable_tls_files_stop_the_coordinator_with_the_file_named(
    tls_files: TlsFiles, tmp_path: Path
) -> None:
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    cases = [
        (
            ["--tls-cert", str(tls_files.server_cert), "--tls-key", str(tls_files.client_key)],
            "must be a certificate and its own private key",
        ),
        (
            ["--tls-cert", str(not_pem), "--tls-key", str(tls_files.server_key)],
            "tls_cert '.*not.pem' must be a PEM file",
        ),
        (["--tls-client-ca", str(tls_files.ca)], "tls_client_ca .* needs tls_cert and tls_key"),
        (["--max-streams", "0"], "--max-streams '0' must be an integer >= 1"),
    ]  # fmt: skip
    for args, message in cases:
        done = subprocess.run(
            [sys.executable, "-m", "sarcomm.coordinator.cli", "--listen", "127.0.0.1:0", "--http",
             "127.0.0.1:0", *args],
            capture_output=True, text=True, timeout=30, env=_clean_env(),
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert re.search(message, done.stderr), done.stderr


# -- limits ------------------------------------------------------------------------------------


LIMITS = (
    "--max-streams", "2", "--max-join-waiters", "2", "--max-world-size", "4",
    "--max-message-bytes", "65536", "--max-jobs", "8",
)  # fmt: skip


async def test_limits_answer_resource_exhausted_naming_the_limit_and_free_up(
    start_coordinator: StartCoordinator, channel_to: Callable[[CoordinatorProcess], grpc.aio.Channel]
) -> None:
    coord = start_coordinator(*QUIET, *LIMITS)
    channel = channel_to(coord)
    stub = pb_grpc.CoordinatorStub(channel)

    async def refused(call: Any, limit: str, stream: bool = False) -> None:
        code, detail = await (stream_code(call) if stream else code_of(call))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, detail
        assert limit in detail

    await refused(stub.Join(join_request("big", "h", world_size=5), timeout=5), "max_world_size")
    await refused(stub.Join(join_request("x" * 70_000, "h"), timeout=5), "")  # gRPC's own message size
    # Two joins wait for their worlds; a third would be one waiter too many.
    waiting = [asyncio.ensure_future(stub.Join(join_request(f"w{i}", "h"), timeout=30)) for i in range(2)]
    await wait_for_async(lambda: _forming(stub, 2), 10, what="two jobs forming")
    await refused(stub.Join(join_request("w2", "h"), timeout=5), "max_join_waiters")
    for call in waiting:
        call.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    await wait_for_async(lambda: _forming(stub, 0), 10, what="no job forming")
    # Two streams open; a third of any kind is refused until one closes. Each watches a formed
    # job, so its first event (sent at once) shows that the coordinator holds its slot.
    for i in range(2):
        await stub.Join(join_request(f"s{i}", "h", world_size=1), timeout=5)
    watches = [stub.Watch(pb.WatchRequest(job=f"s{i}"), timeout=30) for i in range(2)]
    for watch in watches:
        await asyncio.wait_for(watch.read(), 10)
    await refused(stub.Watch(pb.WatchRequest(job="s2"), timeout=5), "max_streams", stream=True)
    await refused(stub.Heartbeat(iter([pb.HeartbeatRequest()]), timeout=5), "max_streams", stream=True)
    watches[0].cancel()
    # The coordinator counts the cancelled Watch just before it gives its slot back, with no
    # await in between: once /metrics shows the count, the slot is free.
    await wait_for_async(
        lambda: _cancelled_watches(coord) >= 1, 10, what="the coordinator to count the cancelled Watch"
    )
    members = await form(stub, "after")  # joins are unary: not streams
    heartbeat = stub.Heartbeat(
        iter(
            [
                pb.HeartbeatRequest(
                    reports=[pb.MemberReport(member_id=m.member_id, secret=m.secret) for m in members]
                )
            ]
        ),
        timeout=5,
    )
    assert (await stream_code(heartbeat))[0] == grpc.StatusCode.OK
    watches[1].cancel()


async def test_a_request_that_is_not_its_message_type_is_invalid_argument(
    coordinator: CoordinatorProcess,
) -> None:
    async with grpc.aio.insecure_channel(coordinator.grpc_target) as channel:
        for method in ("Join", "Leave", "ListJobs"):
            # No serializers: raw bytes go out as they are.
            call = channel.unary_unary(f"/sarcomm.v1.Coordinator/{method}", None, None)
            code, detail = await code_of(call(b"\xff\xff\xff", timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert f"must be a serialized {method} request message" in detail
        stream = channel.stream_stream("/sarcomm.v1.Coordinator/Heartbeat", None, None)
        code, detail = await stream_code(stream(iter([b"\x0a\x05ab"]), timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "Heartbeat request message" in detail


def test_limit_flags_and_variables_reach_the_config() -> None:
    args = coordinator_cli.parse_args(
        ["--max-join-waiters", "9"], {"SARCOMM_MAX_STREAMS": "7", "SARCOMM_MAX_ENDED_JOBS": "3"}
    )
    config = coordinator_cli.config_from_args(args)
    assert (config.limits.max_streams, config.limits.max_ended_jobs, config.limits.max_join_waiters) == (
        7,
        3,
        9,
    )


# -- helpers -----------------------------------------------------------------------------------


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}


async def _sar_worker(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [*SAR_WORKER, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**_clean_env(), **env},
    )


def _cancelled_watches(coord: CoordinatorProcess) -> float:
    """``sar_coordinator_rpcs_total{method="Watch",code="CANCELLED"}``, 0 before the first."""
    status, text = http_get(coord, "/metrics")
    assert status == 200, text
    found = re.search(r'^sar_coordinator_rpcs_total\{code="CANCELLED",method="Watch"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def _forming(stub: pb_grpc.CoordinatorAsyncStub, count: int) -> bool:
    jobs = (await stub.ListJobs(pb.ListJobsRequest(), timeout=5)).jobs
    return sum(1 for j in jobs if j.state == "FORMING") == count


@pytest.fixture(autouse=True)
def _no_inherited_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("SARCOMM_")]:
        monkeypatch.delenv(name)


def test_sar_worker_reads_tls_from_flags_and_variables_and_the_flag_wins(tls_files: TlsFiles) -> None:
    from sarcomm.worker.agent import cli as worker_cli

    base = ["--coord", "head:50051", "--job", "j", "--world-size", "2", "--", "true"]
    env = {"SARCOMM_TLS_CA": str(tls_files.rogue_ca), "SARCOMM_TLS_CERT": str(tls_files.client_cert),
           "SARCOMM_TLS_KEY": str(tls_files.client_key)}  # fmt: skip
    config, *_ = worker_cli.parse(["--tls-ca", str(tls_files.ca), *base], env)
    assert config.tls == ClientTls(tls_files.ca, tls_files.client_cert, tls_files.client_key)
    config, *_ = worker_cli.parse(base, {})
    assert config.tls is None
    # A process that registers itself reads the same variables (sarcomm.worker.launch_env).
    assert client_tls_setting(env) == ClientTls(
        tls_files.rogue_ca, tls_files.client_cert, tls_files.client_key
    )
    assert client_tls_setting({}) is None

"""``sar-coordinator --acceptors N``: N gRPC servers of one process share the --listen port, the
kernel spreading new connections over them. Every acceptor serves the whole service on one
membership; the port stays closed to any other process; a stop closes them all."""

from __future__ import annotations

import asyncio
import signal

import grpc
import psutil
import pytest

from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.helpers import LO_PB as LO
from tests.helpers import free_port, port_taken, read_message, wait_for
from tests.test_state_file import refused

pytestmark = pytest.mark.integration

ACCEPTORS = 4
#: Connections (one channel each), enough that the kernel's hash gives every acceptor some.
HOSTS = 32


def listeners(coordinator: CoordinatorProcess) -> int:
    """The listening sockets the coordinator's process holds on its gRPC port."""
    assert coordinator.proc is not None
    found = psutil.Process(coordinator.proc.pid).net_connections(kind="tcp")
    return sum(1 for c in found if c.status == psutil.CONN_LISTEN and c.laddr.port == coordinator.grpc_port)


async def test_acceptors_share_the_port_and_serve_one_membership(start_coordinator: StartCoordinator) -> None:
    coordinator = start_coordinator("--acceptors", str(ACCEPTORS), "--heartbeat-interval", "0.5")
    assert listeners(coordinator) == ACCEPTORS
    channels = [grpc.aio.insecure_channel(coordinator.grpc_target) for _ in range(HOSTS)]
    try:
        stubs = [pb_grpc.CoordinatorStub(channel) for channel in channels]
        answers = await asyncio.gather(
            *(
                stub.Join(
                    pb.JoinRequest(
                        job="shared", world_size=HOSTS, host=f"h{i}", interfaces=[LO], store_port=29500
                    ),
                    timeout=20,
                )
                for i, stub in enumerate(stubs)
            )
        )
        # One world, whichever acceptor each connection landed on: every rank once, one master.
        assert sorted(a.assignments[0].rank for a in answers) == list(range(HOSTS))
        assert {(a.generation, a.world_size, a.master_port) for a in answers} == {(1, HOSTS, 29500)}
        streams = [
            stub.Heartbeat(
                iter([pb.HeartbeatRequest(reports=[pb.MemberReport(member_id=a.assignments[0].member_id,
                                                                   secret=a.assignments[0].secret)])]),
                timeout=20,
            )
            for stub, a in zip(stubs, answers, strict=True)
        ]  # fmt: skip
        acks = await asyncio.gather(*(read_message(s, pb.HeartbeatResponse, 20) for s in streams))
        assert all(not ack.unknown_members and ack.heartbeat_interval_seconds == 0.5 for ack in acks)
        # A failure reported through one acceptor reaches the streams of all of them.
        watch = stubs[1].Watch(pb.WatchRequest(job="shared"), timeout=20)
        assert (await read_message(watch, pb.JobEvent, 20)).kind == pb.JobEvent.WORLD_FORMED
        first = answers[0].assignments[0]
        await stubs[0].Leave(pb.LeaveRequest(member_id=first.member_id, secret=first.secret, exit_code=3))
        kinds = set()
        while pb.JobEvent.JOB_FAILED not in kinds:
            kinds.add((await read_message(watch, pb.JobEvent, 20)).kind)
        metrics = coordinator.get_text("/metrics")
        assert 'sar_coordinator_members{state="FAILED"} 1.0' in metrics
        assert f'sar_coordinator_rpcs_total{{code="OK",method="Join"}} {float(HOSTS)}' in metrics
        for stream in streams:
            stream.cancel()
        watch.cancel()
    finally:
        await asyncio.gather(*(channel.close(None) for channel in channels))


def test_the_port_stays_closed_to_other_processes(start_coordinator: StartCoordinator) -> None:
    coordinator = start_coordinator("--acceptors", str(ACCEPTORS))
    taken = f"127.0.0.1:{coordinator.grpc_port}"
    line = refused("--listen", taken, "--http", f"127.0.0.1:{free_port()}", "--acceptors", str(ACCEPTORS))
    assert line == (
        f"sar-coordinator: --listen {taken}: cannot listen there (address already in use); another "
        "process (another sar-coordinator?) holds the port: stop it or choose another --listen"
    )
    assert listeners(coordinator) == ACCEPTORS  # the first one serves on


def test_a_stop_closes_every_acceptor(start_coordinator: StartCoordinator) -> None:
    coordinator = start_coordinator("--acceptors", str(ACCEPTORS))
    assert coordinator.stop(signal.SIGTERM) == 0
    # The port is free again for anyone (no acceptor was left behind).
    wait_for(lambda: not port_taken(coordinator.grpc_port), 10, what="the gRPC port to be free")


@pytest.mark.parametrize("value", ["0", "65", "two"])
def test_acceptors_out_of_range_are_refused_in_one_line(value: str) -> None:
    line = refused("--acceptors", value, "--listen", f"127.0.0.1:{free_port()}")
    assert line == f"sar-coordinator: --acceptors {value!r} must be an integer in 1..64."

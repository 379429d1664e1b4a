"""The start-up decisions of sarcomm's communication, in one process: the backend (auto, or why one
is not available), the device, the CPU side group of an nccl job and what goes through it, the
timeouts, the socket variables, ``initialize_comms``' argument checks, and the refusals before it.
No GPU is needed: NCCL and CUDA are mocked (a fake probe, a sentinel side group), because the test
machines have no GPU. The collectives in real gloo groups: tests/test_collectives.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sarcomm.common.errors import FailedPreconditionError, InvalidArgumentError
from sarcomm.worker import launch_env
from sarcomm.worker.library import backends, collectives, comm, metrics
from sarcomm.worker.library.backends import BackendProbe
from sarcomm.worker.library.collectives import timing


def probe(**overrides: Any) -> BackendProbe:
    values: dict[str, Any] = {
        "cuda_available": False,
        "cuda_device_count": 0,
        "gloo": True,
        "nccl": True,
        "mpi": False,
        "ucc": False,
        "ccl": False,
    }
    values.update(overrides)
    return BackendProbe(**values)


def test_choose_backend_auto_is_gloo_without_cuda_and_nccl_with_it() -> None:
    assert backends.choose_backend("auto", probe()) == "gloo"
    assert backends.choose_backend("auto", probe(cuda_available=True, cuda_device_count=2)) == "nccl"
    assert backends.choose_backend("auto", probe(cuda_available=True, cuda_device_count=0)) == "gloo"


def test_choose_backend_names_why_and_what_is_available_if_unavailable() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        backends.choose_backend("nccl", probe())
    assert str(info.value) == (
        "backend 'nccl' is not available: torch.cuda.is_available() is False; available: gloo."
    )
    with pytest.raises(
        InvalidArgumentError, match=r"^backend 'mpi' is not available: dist\.is_mpi_available\(\) is False"
    ):
        backends.choose_backend("mpi", probe())
    with pytest.raises(
        InvalidArgumentError,
        match=r"^backend 'ccl' is not available: the oneccl_bindings_for_pytorch package is not installed; "
        r"available: gloo, mpi\.$",
    ):
        backends.choose_backend("ccl", probe(mpi=True))
    with pytest.raises(
        InvalidArgumentError, match=r"^backend 'tcp' is not one of auto, gloo, nccl, ccl, mpi, ucc\.$"
    ):
        backends.choose_backend("tcp", probe())


def test_choose_comm_device_is_the_local_gpu_for_nccl_and_cpu_otherwise() -> None:
    gpus = probe(cuda_available=True, cuda_device_count=2)
    assert backends.choose_comm_device("nccl", None, 1, gpus) == torch.device("cuda", 1)
    assert backends.choose_comm_device("gloo", None, 1, gpus) == torch.device("cpu")
    assert backends.choose_comm_device("nccl", "cuda:0", 1, gpus) == torch.device("cuda", 0)
    with pytest.raises(InvalidArgumentError, match=r"^LOCAL_RANK 2 has no CUDA device: this host shows 2;"):
        backends.choose_comm_device("nccl", None, 2, gpus)
    with pytest.raises(InvalidArgumentError, match=r"^comm_device 'gpu0' is not a torch device"):
        backends.choose_comm_device("gloo", "gpu0", 0, gpus)


def test_only_nccl_gets_a_cpu_side_group_and_only_cpu_tensors_use_it() -> None:
    assert backends.needs_cpu_side_group("nccl")
    assert not any(backends.needs_cpu_side_group(name) for name in ("gloo", "mpi", "ucc", "ccl"))
    assert backends.uses_cpu_side_group(tensor_is_cpu=True, has_side_group=True)
    assert not backends.uses_cpu_side_group(tensor_is_cpu=False, has_side_group=True)
    assert not backends.uses_cpu_side_group(tensor_is_cpu=True, has_side_group=False)


def test_adopted_backend_reads_torch_mixed_backend_names() -> None:
    gpus = probe(cuda_available=True, cuda_device_count=1)
    assert backends.adopted_backend("gloo", None, probe()) == ("gloo", True)
    assert backends.adopted_backend("nccl", None, gpus) == ("nccl", False)
    assert backends.adopted_backend("cpu:gloo,cuda:nccl", None, gpus) == ("nccl", True)
    assert backends.adopted_backend("cpu:gloo,cuda:nccl", None, probe()) == ("gloo", True)


@pytest.mark.parametrize(
    ("variable", "read", "default"),
    [
        ("SAR_COLLECTIVE_TIMEOUT", launch_env.collective_timeout_setting, 300),
        ("SAR_EXIT_TIMEOUT", launch_env.exit_timeout_setting, 30),
    ],
)
def test_timeouts_have_their_default_and_read_their_variable(
    variable: str, read: Callable[[dict[str, str]], float], default: int
) -> None:
    assert read({}) == default
    assert read({variable: "12.5"}) == 12.5
    for bad in ("abc", "0", "-3", "inf", "nan"):
        with pytest.raises(
            InvalidArgumentError,
            match=rf"^{variable}='{bad}' is not a valid timeout: it must be a positive number of seconds, "
            r"at most 604800 \(a week\)\.$",
        ):
            read({variable: bad})


def test_socket_environment_fills_only_interface_variables_the_user_left_unset() -> None:
    assert launch_env.socket_environment({}) == {}
    env = {"SAR_SOCKET_NAME": "ib0", "NCCL_SOCKET_IFNAME": "eth7"}
    assert launch_env.socket_environment(env) == {
        "GLOO_SOCKET_IFNAME": "ib0",
        "TP_SOCKET_IFNAME": "ib0",
        "CCL_SOCKET_IFNAME": "ib0",
    }


def test_initialize_comms_needs_a_port_when_none_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(
        InvalidArgumentError, match=r"^master_port_number is None and MASTER_PORT is not set: "
    ):
        comm.initialize_comms(0, 2, "127.0.0.1", "gloo")
    monkeypatch.setenv("MASTER_PORT", "port")
    with pytest.raises(
        InvalidArgumentError, match=r"^MASTER_PORT='port' is not an integer port in 1\.\.65535\.$"
    ):
        comm.initialize_comms(0, 2, "127.0.0.1", "gloo")
    assert not dist.is_initialized()


def test_initialize_comms_rejects_bad_arguments_before_touching_the_network(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"^rank=2 must be an integer in 0\.\.world_size-1 \(world_size=2\)\.$"
    ):
        comm.initialize_comms(2, 2, "127.0.0.1", "gloo", master_port_number=1234)
    with pytest.raises(InvalidArgumentError, match=r"^backend 'nccl' is not available: "):
        comm.initialize_comms(0, 2, "127.0.0.1", "nccl", master_port_number=1234)
    with pytest.raises(InvalidArgumentError, match=r"^master_port_number=70000 is not an integer port"):
        comm.initialize_comms(0, 2, "127.0.0.1", "gloo", master_port_number=70000)
    monkeypatch.setenv("SAR_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(InvalidArgumentError, match=r"^SAR_COLLECTIVE_TIMEOUT='soon' is not a valid timeout"):
        comm.initialize_comms(0, 2, "127.0.0.1", "gloo", master_port_number=1234)
    assert not dist.is_initialized()


def test_getters_and_collectives_refuse_before_initialize_comms() -> None:
    assert not comm.is_initialized()
    with pytest.raises(FailedPreconditionError, match=r"^sarcomm communication is not initialised"):
        comm.rank()
    with pytest.raises(FailedPreconditionError, match=r"^all_reduce needs initialised communication"):
        collectives.all_reduce(torch.zeros(1))
    with pytest.raises(FailedPreconditionError, match=r"^all_to_all needs initialised communication"):
        collectives.all_to_all([torch.zeros(1)], [torch.zeros(1)])


@pytest.fixture
def fake_nccl_job(monkeypatch: pytest.MonkeyPatch) -> tuple[object, list[tuple[Any, ...]]]:
    """comm.STATE as an nccl job with a CPU side group would have it; dist.all_reduce recorded.

    NCCL is mocked because there is no GPU: the side group is a sentinel object and
    torch.distributed's all_reduce is replaced by a function that records its arguments.
    """
    side_group = object()
    calls: list[tuple[Any, ...]] = []
    state = comm.STATE
    for name, value in {
        "initialized": True,
        "ready": True,
        "rank": 0,
        "world_size": 2,
        "backend": "nccl",
        "comm_device": torch.device("cuda", 0),
        "cpu_group": side_group,
        "cpu_backend": "gloo",
        "stats": {op: metrics.collective_stats(op, "nccl") for op in comm.OPS},
        "cpu_stats": {op: metrics.collective_stats(op, "gloo") for op in comm.OPS},
    }.items():
        monkeypatch.setattr(state, name, value)

    def fake_all_reduce(
        tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False
    ) -> None:
        calls.append((tensor.device.type, group))

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    return side_group, calls


def test_nccl_job_routes_cpu_tensors_through_the_gloo_side_group(
    fake_nccl_job: tuple[object, list[tuple[Any, ...]]],
) -> None:
    side_group, calls = fake_nccl_job
    cpu_before = metrics.collective_stats("all_reduce", "gloo").snapshot().count
    collectives.all_reduce(torch.zeros(2))
    collectives.all_reduce(torch.zeros(2, device="meta"))  # stands in for a CUDA tensor
    assert calls == [("cpu", side_group), ("meta", None)]
    assert metrics.collective_stats("all_reduce", "gloo").snapshot().count == cpu_before + 1
    group, stats = timing.route("broadcast", None, torch.zeros(1))
    assert (group, stats.backend) == (side_group, "gloo")
    explicit = object()
    group, stats = timing.route("broadcast", explicit, torch.zeros(1))  # type: ignore[arg-type]
    assert (group, stats.backend) == (explicit, "nccl")

"""Zero-code metrics, in process: who is instrumented (:func:`decide`), that the entry point never
raises, the opt-outs' wiring, and the nccl completion hook's decisions and error handling.

The hook tests use a FAKE of torch's hook interface (``WorkInfo``, a process group's
``_register_on_completion_hook``): only ProcessGroupNCCL has the hook, and there is no GPU here.
The fake has the attributes torch 2.13's ``WorkInfo`` binds (``op_type``, ``active_duration``,
``time_started``, ``time_finished``) and refuses a second hook as ProcessGroupNCCL does.
``scripts/gpu-check.sh`` runs the real one on a GPU.
"""

from __future__ import annotations

import datetime
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sarcomm.common.messages import Assignment, JoinResult
from sarcomm.worker import bandwidth
from sarcomm.worker.agent import cli
from sarcomm.worker.agent.config import AgentConfig, rank_environment
from sarcomm.worker.autometrics import entry
from sarcomm.worker.autometrics.entry import Decision, decide
from sarcomm.worker.library.gpu_timing import Groups, GroupTiming, hook_decision
from sarcomm.worker.library.metrics import CollectiveStats, collective_stats
from sarcomm.worker.torchrun.settings import RendezvousSettings

TORCHRUN_WORKER = {"RANK": "3", "LOCAL_RANK": "1", "SAR_ENDPOINTS_DIR": "/tmp/e", "SAR_GENERATION": "1"}
SAR_WORKER_RANK = {"RANK": "0", "LOCAL_RANK": "0", "SAR_PROGRESS_FILE": "/tmp/p"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (TORCHRUN_WORKER, Decision(True, "torchrun")),
        (SAR_WORKER_RANK, Decision(True, "sar-worker")),
        # torchrun's agent: it exports SAR_ENDPOINTS_DIR after its rendezvous but has no RANK
        ({"SAR_ENDPOINTS_DIR": "/tmp/e", "SAR_COORD": "h:1"}, Decision(False)),
        ({"RANK": "0", "LOCAL_RANK": "0"}, Decision(False)),  # a rank of another launcher
        ({}, Decision(False)),
        ({**TORCHRUN_WORKER, "SAR_AUTO_METRICS_PID": "7"}, Decision(False, "torchrun")),  # its child
        ({**TORCHRUN_WORKER, "SAR_AUTO_METRICS_PID": "42"}, Decision(False, "torchrun")),  # on already
        ({**SAR_WORKER_RANK, "SAR_AUTO_METRICS": "0"}, Decision(False, "sar-worker")),
        ({**SAR_WORKER_RANK, "SAR_AUTO_METRICS": "1"}, Decision(True, "sar-worker")),
    ],
)
def test_decide_instruments_only_ranks_sarcomm_started(env: dict[str, str], expected: Decision) -> None:
    assert decide(env, 42) == expected


def test_decide_says_why_a_bad_switch_leaves_it_off() -> None:
    decision = decide({**SAR_WORKER_RANK, "SAR_AUTO_METRICS": "yes please"}, 42)
    assert not decision.on
    assert decision.reason == (
        "SAR_AUTO_METRICS='yes please' must be 0 (off) or 1 (on); leaving zero-code metrics off"
    )


def test_load_never_raises_and_says_once_why_metrics_are_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name, value in TORCHRUN_WORKER.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SAR_AUTO_METRICS", raising=False)
    monkeypatch.delenv("SAR_AUTO_METRICS_PID", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ENABLE_TIMING", raising=False)
    monkeypatch.setattr(entry, "_RUNTIME", "sarcomm.worker.no_such_module")
    with caplog.at_level(logging.WARNING, logger=entry.__name__):
        entry.load()
    assert [r.getMessage() for r in caplog.records] == [
        "sarcomm: rank 3: zero-code metrics are off: ModuleNotFoundError: "
        "No module named 'sarcomm.worker.no_such_module'"
    ]


# -- the opt-outs --------------------------------------------------------------------------------


def test_no_auto_metrics_gives_the_ranks_sar_auto_metrics_0() -> None:
    base = ["--coord", "h:1", "--job", "j", "--world-size", "1"]
    config, *_ = cli.parse([*base, "--no-auto-metrics", "--", "x"], {})
    assert not config.auto_metrics
    on, *_ = cli.parse([*base, "--", "x"], {})
    assert on.auto_metrics
    assert "SAR_AUTO_METRICS" not in _rank_env(on)
    assert _rank_env(config)["SAR_AUTO_METRICS"] == "0"


def _rank_env(config: AgentConfig) -> dict[str, str]:
    member = Assignment(
        rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="10.0.0.1",
        master_port=29500, interface="eth1", address="10.0.0.2", generation=1, member_id="m",
        secret="s", job="j", restart_count=0,
    )  # fmt: skip
    joined = JoinResult("j", 1, 1, "10.0.0.1", 29500, "eth1", "10.0.0.2", 0, (member,))
    return rank_environment({}, config, joined, 0, restart_count=0, progress_file=Path("/p"))


@dataclass
class _Params:
    config: dict[str, Any]
    endpoint: str = "h:1"
    run_id: str = "job"
    min_nodes: int = 1
    max_nodes: int = 1


def test_rdzv_conf_auto_metrics_and_torchs_own_switch(caplog: pytest.LogCaptureFixture) -> None:
    assert RendezvousSettings.from_parameters(_Params({}), {}).auto_metrics
    assert not RendezvousSettings.from_parameters(_Params({"auto_metrics": "0"}), {}).auto_metrics
    with pytest.raises(Exception, match=r"--rdzv-conf auto_metrics='maybe' must be 1 \(on\) or 0 \(off\)"):
        RendezvousSettings.from_parameters(_Params({"auto_metrics": "maybe"}), {})
    with caplog.at_level(logging.WARNING):
        RendezvousSettings.from_parameters(_Params({}), {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert [r.getMessage() for r in caplog.records] == [
        "job=job: the workers' zero-code metrics are off: TORCH_DEVICE_BACKEND_AUTOLOAD=0 keeps torch "
        "from loading sarcomm's entry point (a worker that uses sarcomm's library still serves /metrics)"
    ]


# -- the nccl completion hook, against a FAKE of torch's hook interface (no GPU here) -------------


class FakeOpType(enum.Enum):
    ALLREDUCE = 1
    ALLGATHER = 2
    BARRIER = 3


@dataclass
class FakeWorkInfo:
    """torch's ``WorkInfo`` as ProcessGroupNCCL's hook thread hands it over (a fake)."""

    op_type: FakeOpType
    active_duration: datetime.timedelta
    time_started: datetime.datetime = datetime.datetime(2026, 1, 1)
    time_finished: datetime.datetime = datetime.datetime(2026, 1, 1, 0, 0, 1)


@dataclass
class FakeGroup:
    """A process group's hook registration as ProcessGroupNCCL does it (a fake): one hook only,
    and none without TORCH_NCCL_ENABLE_TIMING."""

    group_name: str = "0"
    timing: bool = True
    hooks: list[Callable[[Any], None]] = field(default_factory=list)

    def _register_on_completion_hook(self, hook: Callable[[Any], None]) -> None:
        if not self.timing:
            raise RuntimeError("ProcessGroupNCCL OnCompletion hook requires TORCH_NCCL_ENABLE_TIMING\nmore")
        if self.hooks:
            raise RuntimeError("ProcessGroupNCCL OnCompletion hook already registered")
        self.hooks.append(hook)

    def complete(self, info: FakeWorkInfo) -> None:
        for hook in self.hooks:
            hook(info)


def _ms(value: float) -> datetime.timedelta:
    return datetime.timedelta(milliseconds=value)


def test_the_hook_records_each_works_gpu_time_under_the_noted_stats() -> None:
    errors: list[BaseException] = []
    timing = GroupTiming("nccl", errors.append)
    mine, library = CollectiveStats("all_reduce", "nccl"), None
    timing.expect("ALLREDUCE", mine, 1024, None)
    timing.expect("ALLGATHER", library, 64, None)  # the library's own call: its wrapper records it
    timing.expect("ALLREDUCE", mine, 2048, None)
    timing.on_completion(FakeWorkInfo(FakeOpType.ALLGATHER, _ms(3)))
    timing.on_completion(FakeWorkInfo(FakeOpType.ALLREDUCE, _ms(5)))
    timing.on_completion(FakeWorkInfo(FakeOpType.ALLREDUCE, _ms(0)))  # no events: finished - started
    snap = mine.snapshot()
    assert (snap.count, snap.bytes_sent) == (2, 3072)
    assert snap.sum_seconds == pytest.approx(1.005)
    assert errors == []


def test_a_work_without_a_note_is_recorded_under_its_op_types_label() -> None:
    timing = GroupTiming("fake-nccl", lambda exc: None)
    timing.on_completion(FakeWorkInfo(FakeOpType.BARRIER, _ms(2)))
    snap = collective_stats("barrier", "fake-nccl").snapshot()
    assert (snap.count, snap.bytes_sent) == (1, 0)
    assert snap.sum_seconds == pytest.approx(0.002)


def test_the_hook_never_raises_whatever_fails_in_it() -> None:
    """torch aborts the group's communicators when the hook raises: ours catches everything, even
    an error of its error path, and isolates the user's chained hooks the same way."""
    seen: list[str] = []

    def on_error(exc: BaseException) -> None:
        seen.append(type(exc).__name__)
        raise RuntimeError("the error path fails too")

    class Broken(CollectiveStats):
        def record(self, duration_ns: int, nbytes: int) -> None:
            raise MemoryError("no memory")

    timing = GroupTiming("nccl", on_error)
    timing.user_hooks.append(lambda info: [][0])
    timing.expect("ALLREDUCE", Broken("all_reduce", "nccl"), 8, None)
    timing.on_completion(FakeWorkInfo(FakeOpType.ALLREDUCE, _ms(1)))
    timing.on_completion(object())  # type: ignore[arg-type]  # not a WorkInfo at all
    assert seen == ["MemoryError", "IndexError", "AttributeError", "IndexError"]


def test_groups_register_once_say_why_not_and_chain_the_users_hook() -> None:
    said: list[str] = []
    groups = Groups(lambda exc: None, said.append)

    class FakeProcessGroupClass:
        """Stands for torch's ProcessGroup class, whose method Groups.patch replaces."""

        def _register_on_completion_hook(self, hook: Callable[[Any], None]) -> None:
            FakeGroup._register_on_completion_hook(self, hook)  # type: ignore[arg-type]

    groups.patch(FakeProcessGroupClass)
    hooked = FakeGroup("hooked")
    timing = groups.timing(hooked, "nccl")
    assert timing is not None
    assert groups.timing(hooked, "nccl") is timing  # once per group
    user_calls: list[object] = []
    FakeProcessGroupClass._register_on_completion_hook(hooked, user_calls.append)  # type: ignore[arg-type]
    assert len(hooked.hooks) == 1, "the user's hook is chained behind ours, never refused"
    info = FakeWorkInfo(FakeOpType.BARRIER, _ms(1))
    hooked.complete(info)
    assert user_calls == [info]

    users_first = FakeGroup("users")
    FakeProcessGroupClass._register_on_completion_hook(users_first, user_calls.append)  # type: ignore[arg-type]
    assert groups.timing(users_first, "nccl") is None
    assert groups.timing(FakeGroup("untimed", timing=False), "nccl") is None
    assert groups.timing(FakeGroup("gloo"), "gloo") is None
    assert said == [
        "process group users: collectives on CUDA tensors are not timed (the script registered its own "
        "completion hook on the group first)",
        "process group untimed: collectives on CUDA tensors are not timed (ProcessGroupNCCL OnCompletion "
        "hook requires TORCH_NCCL_ENABLE_TIMING)",
        "process group gloo: collectives on CUDA tensors are not timed (its CUDA backend is gloo, not nccl, "
        "which alone has a completion hook)",
    ]


def test_hook_decision() -> None:
    assert hook_decision("nccl", False) == "hook"
    assert hook_decision("nccl", True).startswith("the script registered")
    assert hook_decision("ucc", False).startswith("its CUDA backend is ucc")


# -- bandwidth -----------------------------------------------------------------------------------


def test_sent_bus_factor_turns_bytes_sent_into_nccl_tests_busbw() -> None:
    """A world of 4, size S bytes in time 1: nccl-tests' busbw is S x its factor; the bytes a rank
    sends per op (all of S, S/4, 3S/4, S at the root) times sent_bus_factor give the same."""
    size, world = 1024.0, 4
    sent = {"all_reduce": size, "all_gather": size / 4, "reduce_scatter": size * 3 / 4,
            "all_to_all": size * 3 / 4, "broadcast": size}  # fmt: skip
    for op, nbytes in sent.items():
        factor, per_sent = bandwidth.bus_factor(op, world), bandwidth.sent_bus_factor(op, world)
        assert factor is not None
        assert per_sent is not None
        assert nbytes * per_sent == pytest.approx(size * factor), op
    assert bandwidth.sent_bus_factor("all_reduce", 1) == 0.0
    assert bandwidth.sent_bus_factor("send", 4) is None

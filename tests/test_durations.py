"""Every duration a user gives sarcomm obeys one rule (:mod:`sarcomm.common.durations`): a finite
number of seconds, at most a week. A larger one is refused in one line naming the setting as the
user wrote it (an ``--rdzv-conf`` key, a flag, a variable, a Join field), its value and the rule,
before it reaches a thread's wait, torch's TCPStore or gRPC, where it crashed with a traceback
(``join_timeout=1e12``: ``OverflowError: timestamp out of range for platform time_t`` from the
loop thread; ``read_timeout=1e15``: ``OverflowError: Python int too large to convert to C int``
from the store). No process, no coordinator: every refusal comes before anything is reached."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.constants import MAX_LAST_CALL_TIMEOUT
from sarcomm.common.durations import MAX_SECONDS, duration
from sarcomm.common.errors import InvalidArgumentError
from sarcomm.common.flags import seconds_up_to
from sarcomm.coordinator import cli as coordinator_cli
from sarcomm.coordinator.api import validation
from sarcomm.coordinator.config import Limits
from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.worker.agent import cli as agent_cli
from sarcomm.worker.launch_env import collective_timeout_setting, heartbeat_interval_setting

RULE = "a positive number of seconds, at most 604800 (a week)"
RULE_ZERO = "a number of seconds >= 0, at most 604800 (a week)"
# Never reached: a refused setting stops the handler before it makes a client.
ENDPOINT = "127.0.0.1:1"


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("join_timeout", "1e12", RULE),
        ("join_timeout", "1e300", RULE),
        ("read_timeout", "1e15", RULE),
        # The Join's own bound, checked in the rendezvous before any call.
        ("last_call_timeout", "1e9", "a number of seconds >= 0, at most 3600"),
        ("last_call_timeout", "3601", "a number of seconds >= 0, at most 3600"),
        ("join_timeout", "inf", RULE),
    ],
)
def test_torchrun_refuses_a_huge_rdzv_conf_duration_naming_key_value_and_rule(
    key: str, value: str, rule: str
) -> None:
    params = RendezvousParameters("sarcomm", ENDPOINT, "big", 1, 1, **{key: value})
    message = f"sarcomm rendezvous: --rdzv-conf {key}={value!r} must be {rule}"
    with pytest.raises(ValueError, match=r"^sarcomm rendezvous: ") as raised:
        get_rendezvous_handler(params)
    assert str(raised.value) == message


def test_a_week_is_the_longest_duration_taken() -> None:
    assert duration(str(MAX_SECONDS)) == duration(MAX_SECONDS) == 604_800.0
    assert duration("0", zero=True) == 0.0
    for bad in ("604800.5", "0", "-1", "nan", "inf", "soon", ""):
        with pytest.raises(ValueError, match=r"^"):
            duration(bad)
    with pytest.raises(ValueError, match="True"):
        duration(True)


@pytest.mark.parametrize(
    ("flag", "rule"),
    [
        ("--join-timeout", RULE),
        ("--heartbeat-interval", RULE),
        # The Join's own bound (0..3600), checked by the agent first (exit 2 naming the flag).
        ("--last-call-timeout", seconds_up_to(MAX_LAST_CALL_TIMEOUT)[1]),
    ],
)
def test_sar_worker_refuses_a_huge_duration_flag(flag: str, rule: str) -> None:
    argv = ["--coord", "head:50051", "--job", "gnn", "--world-size", "2:4", flag, "1e12", "--", "x"]
    with pytest.raises(InvalidArgumentError) as raised:
        agent_cli.parse(argv, {})
    assert str(raised.value) == f"{flag} '1e12' must be {rule}."


@pytest.mark.parametrize(
    ("flag", "rule"),
    [
        ("--join-timeout", RULE),
        ("--heartbeat-interval", RULE),
        ("--stall-threshold", RULE),
        ("--reconnect-grace", RULE_ZERO),
        ("--shutdown-grace", RULE_ZERO),
    ],
)
def test_sar_coordinator_refuses_a_huge_duration_flag(flag: str, rule: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        coordinator_cli.parse_args([flag, "1e12"], {})
    assert str(raised.value) == f"{flag} '1e12' must be {rule}."


@pytest.mark.parametrize(
    ("variable", "read", "message"),
    [
        (
            "SAR_COLLECTIVE_TIMEOUT",
            collective_timeout_setting,
            f"SAR_COLLECTIVE_TIMEOUT='1e12' is not a valid timeout: it must be {RULE}.",
        ),
        (
            "SARCOMM_HEARTBEAT_INTERVAL",
            lambda env: heartbeat_interval_setting(env, None),
            f"SARCOMM_HEARTBEAT_INTERVAL='1e12' must be {RULE}.",
        ),
    ],
)
def test_a_huge_duration_variable_is_refused(
    variable: str, read: Callable[[dict[str, str]], float], message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        read({variable: "1e12"})
    assert str(raised.value) == message


def test_the_coordinator_refuses_a_huge_join_timeout_and_the_client_never_sends_one() -> None:
    request = pb.JoinRequest(
        job="big", world_size=1, host="h", store_port=29500, members=[pb.MemberSpec(local_rank=0)],
        join_timeout_seconds=1e12,
    )  # fmt: skip
    with pytest.raises(InvalidArgumentError) as raised:
        validation.join_spec(request, None, Limits())
    assert str(raised.value) == f"join_timeout_seconds 1000000000000.0 must be {RULE_ZERO}"
    with pytest.raises(InvalidArgumentError) as raised:
        CoordinatorClient("head:50051", timeout=1e12)
    assert str(raised.value) == f"timeout=1000000000000.0 must be {RULE}."

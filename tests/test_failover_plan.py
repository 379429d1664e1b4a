"""The coordinator address list and the failover plan, without a process: the list's one parse
rule (``--coord a:50051,b:50051``, ``SAR_COORD``, an agent's config, a client), and the plan's
decisions (follow a hint, try each replica once a round, back off doubling to the cap, ignore a
stale hint). How clients carry the plan out: tests/test_failover_client.py.
"""

from __future__ import annotations

import pytest

from sarcomm.common.addresses import parse_targets
from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.client.failover import BACKOFF_MAX_S, Failover, Miss, MissKind
from sarcomm.common.errors import InvalidArgumentError
from sarcomm.worker.agent import cli as worker_cli
from sarcomm.worker.agent.config import AgentConfig

# -- one parse rule for the list ---------------------------------------------------------------


def test_parse_targets_keeps_a_single_address_and_splits_a_list() -> None:
    assert parse_targets("head:50051") == ("head:50051",)
    assert parse_targets("a:50051, b:50051 ,[fd00::1]:50051") == ("a:50051", "b:50051", "[fd00::1]:50051")
    assert parse_targets("unix:/run/a.sock,b:1") == ("unix:/run/a.sock", "b:1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "a:1,,b:2",
            "The item 2 of the coordinator address list 'a:1,,b:2' is blank: give addresses separated "
            "by single commas, e.g. a:50051,b:50051.",
        ),
        (
            "a:1,b:2,",
            "The item 3 of the coordinator address list 'a:1,b:2,' is blank: give addresses separated "
            "by single commas, e.g. a:50051,b:50051.",
        ),
        (
            "a:1,b:2,a:1",
            "The item 3 of the coordinator address list 'a:1,b:2,a:1' repeats item 1 ('a:1'): give each "
            "coordinator once.",
        ),
        (
            "a:1,b:70000",
            "The item 2 of the coordinator address list 'a:1,b:70000' is wrong: The coordinator address "
            "'b:70000' must have the form HOST:PORT (e.g. head:50051 or [fd00::1]:50051) with a port in "
            "1..65535.",
        ),
        (
            "a:1,http://b:9400",
            "The item 2 of the coordinator address list 'a:1,http://b:9400' is wrong: The coordinator "
            "address 'http://b:9400' has the scheme 'http', which gRPC does not dial: give HOST:PORT of "
            "sar-coordinator's --listen (e.g. head:50051), not a URL of its --http port.",
        ),
    ],
)
def test_parse_targets_names_the_item_and_the_rule(text: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse_targets(text)
    assert str(caught.value) == message


def test_sar_worker_takes_a_list_from_the_flag_or_sar_coord_and_names_a_bad_item() -> None:
    config, *_ = worker_cli.parse(
        ["--coord", "a:1, b:2", "--job", "j", "--world-size", "1", "--", "true"], {}
    )
    assert config.coord == "a:1,b:2"
    config, *_ = worker_cli.parse(
        ["--job", "j", "--world-size", "1", "--", "true"], {"SARCOMM_COORD": "a:1,b:2"}
    )
    assert config.coord == "a:1,b:2"
    with pytest.raises(InvalidArgumentError) as caught:
        worker_cli.parse(["--coord", "a:1,a:1", "--job", "j", "--world-size", "1", "--", "true"], {})
    assert str(caught.value) == (
        "--coord 'a:1,a:1': The item 2 of the coordinator address list 'a:1,a:1' repeats item 1 "
        "('a:1'): give each coordinator once."
    )
    # A single address keeps its message of before.
    with pytest.raises(InvalidArgumentError) as caught:
        worker_cli.parse(["--coord", "a:0", "--job", "j", "--world-size", "1", "--", "true"], {})
    assert str(caught.value) == "--coord 'a:0' must be HOST:PORT with a port in 1..65535."


def test_an_agent_config_keeps_one_form_of_the_list_and_refuses_a_bad_one() -> None:
    config = AgentConfig(coord=" a:1 , b:2", job="j", world_size=1, command=("x",))
    assert config.coord == "a:1,b:2"  # what the ranks get in SAR_COORD
    with pytest.raises(InvalidArgumentError, match=r"repeats item 1"):
        AgentConfig(coord="a:1,a:1", job="j", world_size=1, command=("x",))


def test_client_refuses_a_bad_list_before_any_call() -> None:
    with pytest.raises(InvalidArgumentError, match=r"item 2 .* is blank"):
        CoordinatorClient("a:1, ,b:2")


# -- the failover plan (pure) --------------------------------------------------------------------


def _plan(*targets: str) -> Failover:
    # The jitter's upper end: the backoff itself.
    return Failover(targets, uniform=lambda low, high: high)


def test_failover_follows_a_hint_at_once_even_to_an_address_not_in_the_list() -> None:
    plan = _plan("a:1", "b:1")
    assert plan.not_leader("a:1", "c:1") == 0.0
    assert plan.current == "c:1"
    assert plan.targets == ["a:1", "b:1", "c:1"]
    assert plan.succeeded("c:1") == "following the leader at c:1 (a:1 is a standby)"
    assert plan.succeeded("c:1") is None  # the same leader: nothing to say


def test_failover_tries_each_replica_once_a_round_then_backs_off_doubling_to_the_cap() -> None:
    plan = _plan("a:1", "b:1", "c:1")
    delays = []
    for _ in range(9):
        delays.append(plan.unreachable(plan.current))
    # Within a round the next replica at once; after each round a doubling wait, capped.
    assert delays == [0.0, 0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.0, 0.4]
    for _ in range(30):
        assert plan.unreachable(plan.current) <= BACKOFF_MAX_S
    assert plan.succeeded("b:1") == "following the leader at b:1 (a:1 is unreachable; c:1 is unreachable)"
    assert plan.unreachable("b:1") == 0.0  # a success resets the round and the backoff


def test_failover_ignores_a_stale_hint_to_a_replica_that_just_failed() -> None:
    plan = _plan("a:1", "b:1")
    plan.succeeded("a:1")
    assert plan.unreachable("a:1") == 0.0  # the leader died: try b at once
    assert plan.current == "b:1"
    # b has not noticed yet and still names a: the round is over, wait, then start again from a.
    assert plan.not_leader("b:1", "a:1") == 0.1
    assert plan.current == "a:1"
    assert plan.not_leader("b:1", "") == 0.0  # a late answer from b while a is tried: noted only
    assert plan.current == "a:1"


def test_a_standby_that_knows_no_leader_sends_the_call_on_and_a_single_address_waits() -> None:
    plan = _plan("a:1", "b:1")
    assert plan.not_leader("a:1", "") == 0.0
    assert plan.current == "b:1"
    single = _plan("a:1")
    assert single.not_leader("a:1", "") == 0.1
    assert single.current == "a:1"


def test_each_failure_is_kept_as_its_kind_and_said_as_before() -> None:
    """The plan keeps why each replica failed as a kind (the retry layer probes only the
    UNREACHABLE ones), and the leader-change line says it in the same words as ever."""
    plan = Failover(["a:1", "b:1", "c:1", "d:1"], uniform=lambda low, high: high)
    plan.not_leader("a:1", "")
    plan.unreachable("b:1", Miss(MissKind.UNREACHABLE, "its connection broke"))
    plan.unreachable("c:1", Miss(MissKind.SILENT, "no answer for 9 s"))
    assert {t: m.kind for t, m in plan.why.items()} == {
        "a:1": MissKind.STANDBY_NO_LEADER,
        "b:1": MissKind.UNREACHABLE,
        "c:1": MissKind.SILENT,
    }
    assert plan.succeeded("d:1") == (
        "following the leader at d:1 (a:1 is a standby that knows no leader; "
        "b:1 is unreachable (its connection broke); c:1 is silent (no answer for 9 s))"
    )

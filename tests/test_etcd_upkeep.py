"""etcd's history and space, in process: which revisions the leader compacts (a fake clock), the
``--etcd-compaction-retention`` flag as a user meets it, what the write-behind does while the
store is full (a store that refuses the way etcd's NOSPACE alarm does, on a real SQLite file),
and that every etcd configuration sarcomm ships compacts. The real etcd is in
tests/test_etcd_space.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from sarcomm.common.errors import ResourceExhaustedError, StoreFullError, StoreUnavailableError
from sarcomm.coordinator import cli as coordinator_cli
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.ha.upkeep import MAX_PERIOD_S, MIN_PERIOD_S, CompactionPlan, upkeep_period
from sarcomm.coordinator.storage.persistence import WriteBehind
from sarcomm.coordinator.storage.store import JobRow, SqliteStore
from tests.helpers import spec, wait_for_async
from tests.test_persistence import CountingStore, stored

ROOT = Path(__file__).resolve().parent.parent
STORE = ["--store", "etcd://127.0.0.1:2379"]


# -- which revisions go ----------------------------------------------------------------------------


def test_compaction_takes_only_revisions_older_than_the_retention() -> None:
    plan = CompactionPlan(300.0)
    assert plan.observe(0.0, 10) is None
    assert plan.observe(60.0, 50) is None
    assert plan.observe(299.0, 90) is None  # nothing seen 300 s ago yet
    assert plan.observe(300.0, 95) == 10  # what was current 300 s ago: older revisions go
    plan.done(10)
    assert plan.observe(330.0, 99) is None  # nothing newer is 300 s old
    assert plan.observe(400.0, 120) == 50
    plan.done(50)
    assert plan.observe(700.0, 120) == 120  # etcd idle: compacts up to its last revision


def test_compaction_retention_zero_compacts_nothing() -> None:
    plan = CompactionPlan(0.0)
    assert all(plan.observe(t * 1000.0, t) is None for t in range(1, 50))


def test_a_compaction_not_done_is_not_taken_as_done() -> None:
    plan = CompactionPlan(10.0)
    plan.observe(0.0, 5)
    assert plan.observe(10.0, 9) == 5  # not leading, say: not done
    assert plan.observe(20.0, 12) == 9


def test_the_upkeep_looks_a_fifth_of_the_retention_within_bounds() -> None:
    assert upkeep_period(300.0) == MAX_PERIOD_S
    assert upkeep_period(20.0) == 4.0
    assert upkeep_period(1.0) == MIN_PERIOD_S
    assert upkeep_period(0.0) == MAX_PERIOD_S


# -- the flag --------------------------------------------------------------------------------------


def test_retention_defaults_to_five_minutes_and_takes_zero() -> None:
    parsed = coordinator_cli.parse_args(STORE, {})
    store = coordinator_cli.config_from_args(parsed).store
    assert store is not None
    assert store.compaction_retention == 300.0
    parsed = coordinator_cli.parse_args(STORE, {"SARCOMM_ETCD_COMPACTION_RETENTION": "0"})
    store = coordinator_cli.config_from_args(parsed).store
    assert store is not None
    assert store.compaction_retention == 0.0


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--etcd-compaction-retention", "0.5"], {}, "--etcd-compaction-retention"),
        (["--etcd-compaction-retention", "nan"], {}, "--etcd-compaction-retention"),
        (["--etcd-compaction-retention", "1e9"], {}, "--etcd-compaction-retention"),
        ([], {"SARCOMM_ETCD_COMPACTION_RETENTION": "-1"}, "SARCOMM_ETCD_COMPACTION_RETENTION"),
    ],
)
def test_a_bad_retention_exits_2_with_one_line_naming_it_and_the_rule(
    args: list[str], env: dict[str, str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert coordinator_cli.main([*STORE, *args], env=env) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert named in err, err
    assert "must be 0" in err, err


def test_a_retention_without_a_store_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert coordinator_cli.main(["--etcd-compaction-retention", "60"], env={}) == 2
    assert "--etcd-compaction-retention" in capsys.readouterr().err


# -- a full store ----------------------------------------------------------------------------------


class FullStore(CountingStore):
    """SQLite that refuses every write while ``full``, as etcd does under its NOSPACE alarm."""

    full = False

    def write_rows(self, rows: list[JobRow]) -> None:
        if self.full:
            raise StoreFullError("etcd refused to write: it raised the NOSPACE alarm; etcdctl alarm disarm")
        super().write_rows(rows)


async def test_a_full_store_is_resource_exhausted_logged_once_and_written_when_space_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("sarcomm.coordinator.storage.persistence.RETRY_DELAY_S", 0.02)
    store = FullStore(SqliteStore(tmp_path / "state.sqlite"))
    writes = WriteBehind(store)
    membership = Membership(liveness_timeout=30.0, persist=writes.mark)
    ticket = membership.join(spec("a", job="j", world_size=1))
    await writes.durable()
    store.full = True
    with caplog.at_level(logging.DEBUG, logger="sarcomm.coordinator.storage.persistence"):
        membership.leave(ticket.members[0].member_id, ticket.secrets[0], 0)
        # RESOURCE_EXHAUSTED, naming the cause: not UNAVAILABLE, which clients resend at once.
        with pytest.raises(StoreFullError, match="NOSPACE") as refused:
            await writes.durable()
        assert isinstance(refused.value, ResourceExhaustedError)
        assert isinstance(refused.value, StoreUnavailableError)  # retried as for an unreachable store
        await wait_for_async(
            lambda: sum("NOSPACE" in r.getMessage() for r in caplog.records) >= 3, 5, what="retries"
        )
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        store.full = False
        await wait_for_async(
            lambda: any("takes writes again" in r.getMessage() for r in caplog.records), 5, what="recovery"
        )
    # The change kept meanwhile is in the store: no job lost.
    assert stored(store)["j"]["state"] == "FINISHED"
    await writes.close()
    store.close()


# -- every etcd sarcomm ships compacts -------------------------------------------------------------


def test_the_compose_etcd_members_auto_compact() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.etcd.yml").read_text())["services"]
    members = [s for s in services.values() if "--initial-cluster-token" in s.get("command", [])]
    assert len(members) == 3
    for member in members:
        command = member["command"]
        assert command[command.index("--auto-compaction-mode") + 1] == "periodic"
        assert command[command.index("--auto-compaction-retention") + 1] == "5m"

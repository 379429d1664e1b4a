"""The election's pure decisions (who leads, until when a lease is surely alive) and the
``sar-coordinator`` flags of the etcd store. No etcd needed: the I/O is tested on a real cluster
in test_ha_etcd.py and test_ha_etcd_partition.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from sarcomm.coordinator.cli import main
from sarcomm.coordinator.config import CoordinatorConfig
from sarcomm.coordinator.ha.leadership import (
    STANDBY_UNKNOWN,
    Decision,
    LeaderRecord,
    LeaseClock,
    Observed,
    Role,
    decide,
)
from sarcomm.coordinator.storage.etcd_config import EtcdSettings

ME, OTHER = LeaderRecord("a:50051", "a:1:x"), LeaderRecord("b:50051", "b:2:y")


def test_decide_leads_only_while_our_live_lease_owns_the_key() -> None:
    assert decide(Observed(ME, 7, 42), lease=7, lease_valid=True) == Decision(Role.LEADER, "a:50051", 42)
    # Our key, but our lease is in doubt (a renewal overdue): stand by, naming nobody.
    assert decide(Observed(ME, 7, 42), lease=7, lease_valid=False) == STANDBY_UNKNOWN
    assert decide(Observed(OTHER, 9, 43), lease=7, lease_valid=True) == Decision(Role.STANDBY, "b:50051")
    assert decide(None, lease=7, lease_valid=True) == STANDBY_UNKNOWN
    assert decide(Observed(None, 9, 43), lease=7, lease_valid=True) == STANDBY_UNKNOWN
    # Our own key from an earlier lease (it expires in etcd soon): we never name ourselves.
    assert decide(Observed(ME, 5, 41), lease=7, lease_valid=True, replica=ME.replica) == STANDBY_UNKNOWN


def test_a_lease_is_alive_until_the_send_time_of_its_last_renewal_plus_the_ttl() -> None:
    clock = LeaseClock()
    assert not clock.valid(0.0)
    # Sent at 10.0, answered late (at 11.5): valid until 10.0 + 5 less a margin of 0.25 s, never
    # from 11.5, so the leader stops before etcd (which counts from when the renewal arrived)
    # expires the lease.
    clock.renewed(sent_at=10.0, ttl=5)
    assert clock.valid(14.74)
    assert not clock.valid(14.75)
    clock.renewed(sent_at=10.0, ttl=1)  # a tenth of a short TTL
    assert clock.valid(10.89)
    assert not clock.valid(10.9)
    clock.renewed(sent_at=12.0, ttl=0)  # etcd no longer has the lease
    assert not clock.valid(12.0)


def test_the_leader_record_round_trips_and_garbage_is_nobody() -> None:
    assert LeaderRecord.decode(ME.encode()) == ME
    assert LeaderRecord.decode(b"not json") is None
    assert LeaderRecord.decode(b'{"address": "x"}') is None


def test_store_and_state_together_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--store", "etcd://127.0.0.1:2379", "--state", str(tmp_path / "s.sqlite")], env={})
    assert code == 2
    err = capsys.readouterr().err
    assert "--store etcd://127.0.0.1:2379 and --state" in err
    assert "give one" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--store", "etcd://h:2379", "--leader-ttl", "2.5"],
            "--leader-ttl '2.5' must be a whole number of seconds in 1..3600",
        ),
        (
            ["--store", "etcd://h:2379", "--leader-ttl", "0"],
            "--leader-ttl '0' must be a whole number of seconds in 1..3600",
        ),
        (["--etcd-user", "root"], "--etcd-user configure(s) the etcd store, but no --store"),
        (["--store", "etcd://h:2379", "--etcd-user", "root"], "--etcd-user and --etcd-password-file"),
        (["--store", "mysql://h:1"], "scheme 'mysql' must be 'etcd'"),
        (["--store", "etcd://h:2379", "--advertise", "0.0.0.0:50051"], "advertise '0.0.0.0:50051' must be"),
    ],
)
def test_bad_etcd_flags_are_refused_with_a_line_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv, env={}) == 2
    # One line saying it (argparse's own errors come after its usage text).
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_store_flag_reads_its_environment_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--state", "/nonexistent/x.sqlite"], env={"SARCOMM_STORE": "etcd://h:2379"}) == 2
    assert "--store etcd://h:2379 and --state" in capsys.readouterr().err


def test_advertise_defaults_to_listen_with_the_wildcard_replaced_by_the_host_name() -> None:
    assert CoordinatorConfig(listen="10.0.0.5:50051").advertised == "10.0.0.5:50051"
    assert CoordinatorConfig(listen="0.0.0.0:50051", advertise="head1:50051").advertised == "head1:50051"
    wildcard = CoordinatorConfig(listen="0.0.0.0:50051").advertised
    assert wildcard.endswith(":50051")
    assert not wildcard.startswith("0.0.0.0")
    assert EtcdSettings("etcd://h:1/x").describe() == "etcd at h:1 (prefix /x)"

"""The state stores against one contract (SQLite and etcd pass the same tests), etcd's fencing,
and the ``--store`` settings' validation. etcd tests run a real three-member cluster: one for the
module, a test's own where it kills members or turns on auth or TLS."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sarcomm.common.errors import InvalidArgumentError, LeadershipLostError, StoreUnavailableError
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.ha.leadership import LeaderRecord
from sarcomm.coordinator.storage import etcd_client
from sarcomm.coordinator.storage.etcd_client import EtcdClient
from sarcomm.coordinator.storage.etcd_config import EtcdSettings, parse_store_url
from sarcomm.coordinator.storage.etcd_store import EtcdStore
from sarcomm.coordinator.storage.records import job_record, load_state
from sarcomm.coordinator.storage.store import SqliteStore, StateStore, encode_job
from tests.conftest import STORES
from tests.etcd_cluster import ETCD_MISSING, EtcdCluster, running_cluster
from tests.helpers import FakeClock, spec, wait_for
from tests.tls_files import make_tls_files


def lead(client: EtcdClient, store: EtcdStore, ttl: int = 60) -> int:
    """Take the leader key with a fresh lease, fence the store on it; returns the lease."""
    lease, _ = client.grant(ttl)
    answer = client.txn(
        "campaign",
        [etcd_client.compare_create_revision(store.leader_key, 0)],
        [etcd_client.put(store.leader_key, LeaderRecord("t:1", "t").encode(), lease)],
    )
    assert answer.succeeded
    store.fence(int(answer.header.revision))
    return lease


@pytest.fixture(params=STORES)
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    if request.param == "sqlite":
        sqlite = SqliteStore(tmp_path / "state.sqlite")
        yield sqlite
        sqlite.close()
        return
    cluster: EtcdCluster = request.getfixturevalue("module_etcd_cluster")
    prefix = request.getfixturevalue("etcd_prefix")
    client = EtcdClient(EtcdSettings(cluster.url(prefix)))
    store = EtcdStore(client, "/" + prefix)
    lead(client, store)
    yield store
    store.close()
    client.close()


def _formed_job(name: str, world: int = 2) -> dict[str, object]:
    membership = Membership(liveness_timeout=30.0, clock=FakeClock())
    for i in range(world):
        membership.join(spec(f"host{i}", job=name, world_size=world))
    job = membership.job(name)
    assert job is not None
    return job_record(job)


def test_a_store_gives_back_the_latest_generation_of_each_job_and_every_highest_generation(
    any_store: StateStore,
) -> None:
    first = _formed_job("alpha")
    second = {**_formed_job("alpha"), "generation": 2, "state": "FAILED"}
    other = _formed_job("beta", 3)
    any_store.write_rows([encode_job(first), encode_job(other)])
    any_store.write_rows([encode_job(second)])
    loaded = {record["name"]: record for record in any_store.load_jobs()}
    assert loaded["alpha"]["generation"] == 2
    assert loaded["alpha"]["state"] == "FAILED"
    assert loaded["beta"] == json.loads(json.dumps(other))
    assert any_store.last_generations() == {"alpha": 2, "beta": 1}
    state = load_state(any_store)
    assert sorted(job.name for job in state.jobs) == ["alpha", "beta"]


def test_a_store_rewrites_a_record_in_place_and_keeps_a_large_one_whole(any_store: StateStore) -> None:
    big = _formed_job("big", 1024)
    any_store.write_rows([encode_job(big)])
    big["state"] = "FINISHED"
    any_store.write_rows([encode_job(big)])
    (loaded,) = any_store.load_jobs()
    assert loaded["state"] == "FINISHED"
    assert len(loaded["members"]) == 1024
    assert sorted(m["rank"] for m in loaded["members"]) == list(range(1024))


def test_a_store_writes_many_jobs_in_one_call(any_store: StateStore) -> None:
    rows = [encode_job(_formed_job(f"j{i:03d}", 1)) for i in range(250)]
    any_store.write_rows(rows)
    assert len(any_store.load_jobs()) == 250


def test_etcd_refuses_a_write_after_the_leader_lease_expired(
    module_etcd_cluster: EtcdCluster, etcd_prefix: str
) -> None:
    client = EtcdClient(EtcdSettings(module_etcd_cluster.url(etcd_prefix)))
    store = EtcdStore(client, "/" + etcd_prefix)
    fenced: list[bool] = []
    store.on_fenced = lambda: fenced.append(True)
    try:
        lease = lead(client, store, ttl=1)
        store.write_rows([encode_job(_formed_job("before"))])
        # Nobody renews the lease: etcd expires it and deletes the leader key with it.
        wait_for(lambda: client.get(store.leader_key) is None, 10, what="etcd to expire the 1 s lease")
        started = time.monotonic()
        with pytest.raises(LeadershipLostError, match="no longer leads"):
            store.write_rows([encode_job(_formed_job("after"))])
        assert fenced == [True]
        assert time.monotonic() - started < 2
        # And a later leader's key does not let the old fence through either.
        lead(client, EtcdStore(client, "/" + etcd_prefix))
        store.fence(1)
        with pytest.raises(LeadershipLostError):
            store.write_rows([encode_job(_formed_job("after"))])
        assert [r["name"] for r in store.load_jobs()] == ["before"]
        del lease
    finally:
        client.close()


def test_a_store_without_the_quorum_raises_unavailable_naming_etcd(etcd_cluster: EtcdCluster) -> None:
    client = EtcdClient(EtcdSettings(etcd_cluster.url("quorum")), timeout=1.0)
    store = EtcdStore(client, "/quorum")
    try:
        lead(client, store)
        stopped = etcd_cluster.lose_quorum()
        with pytest.raises(StoreUnavailableError, match=r"^etcd at .* could not write 1 job record"):
            store.write_rows([encode_job(_formed_job("q"))])
        etcd_cluster.regain_quorum(stopped)
        wait_for(
            lambda: _writes(store, encode_job(_formed_job("q"))),
            20,
            what="writes to succeed with the quorum back",
        )
        assert [r["name"] for r in store.load_jobs()] == ["q"]
    finally:
        client.close()


def _writes(store: EtcdStore, row: tuple[str, int, str, str]) -> bool:
    try:
        store.write_rows([row])
    except StoreUnavailableError:
        return False
    return True


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://a:2379", "scheme 'http' must be 'etcd'"),
        ("etcd://", "must name at least one endpoint"),
        ("etcd://a", "endpoint 'a' must be HOST:PORT"),
        ("etcd://a:0", "port '0' must be a number in 1..65535"),
        ("etcd://a:99999", "port '99999'"),
        ("etcd://a_b:2379", "host 'a_b' must be a host name or an IP address"),
        ("etcd://a:1,a:1", "names an endpoint twice"),
        ("etcd://a:1/", "segment '' must be"),
        ("etcd://a:1/x/../y", "segment '..'"),
        ("etcd://user:pw@a:1", "must hold no user"),
        ("etcd://[zz]:1", "must be [IPv6]:PORT"),
    ],
)
def test_a_bad_store_url_is_refused_naming_the_part_and_the_rule(url: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        parse_store_url(url)
    assert message in str(error.value)
    assert str(error.value).startswith(f"--store {url!r}: ")


def test_a_store_url_gives_its_endpoints_and_prefix() -> None:
    assert parse_store_url("etcd://10.0.0.1:2379,[fd00::1]:2379,etcd-0.svc:2379/team/a") == (
        (("10.0.0.1", 2379), ("fd00::1", 2379), ("etcd-0.svc", 2379)),
        "/team/a",
    )
    assert parse_store_url("etcd://h:1")[1] == "/sarcomm"


def test_etcd_settings_name_the_flag_value_and_rule(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"--leader-ttl 0 must be a whole number of seconds >= 1"):
        EtcdSettings("etcd://h:1", leader_ttl=0)
    with pytest.raises(InvalidArgumentError, match="must be given together"):
        EtcdSettings("etcd://h:1", cacert=tmp_path, cert=tmp_path / "c.pem")
    with pytest.raises(InvalidArgumentError, match="--etcd-user 'u' and --etcd-password-file"):
        EtcdSettings("etcd://h:1", user="u")
    with pytest.raises(InvalidArgumentError, match=r"--etcd-cacert .* must be a readable file"):
        EtcdSettings("etcd://h:1", cacert=tmp_path / "missing.pem")


def test_etcd_auth_is_used_and_a_wrong_password_is_named(etcd_cluster: EtcdCluster, tmp_path: Path) -> None:
    etcd_cluster.etcdctl("user", "add", "root", "--new-user-password", "s3cret")
    etcd_cluster.etcdctl("auth", "enable")
    try:
        client = EtcdClient(EtcdSettings(etcd_cluster.url("auth"), user="root", password="s3cret"))
        store = EtcdStore(client, "/auth")
        lead(client, store)
        store.write_rows([encode_job(_formed_job("authed"))])
        assert [r["name"] for r in store.load_jobs()] == ["authed"]
        client.close()
        wrong = EtcdClient(EtcdSettings(etcd_cluster.url("auth"), user="root", password="nope"))
        with pytest.raises(StoreUnavailableError, match="check --etcd-user and --etcd-password-file"):
            EtcdStore(wrong, "/auth").load_jobs()
        wrong.close()
    finally:
        etcd_cluster.etcdctl("--user", "root:s3cret", "auth", "disable")


@pytest.mark.etcd
def test_etcd_over_mutual_tls_with_the_coordinators_client_certificate(tmp_path: Path) -> None:
    if ETCD_MISSING:
        pytest.skip(ETCD_MISSING)
    tls = make_tls_files(tmp_path)
    with running_cluster(tmp_path / "etcd", client_tls=(tls.ca, tls.server_cert, tls.server_key)) as cluster:
        settings = EtcdSettings(cluster.url("tls"), cacert=tls.ca, cert=tls.client_cert, key=tls.client_key)
        client = EtcdClient(settings)
        store = EtcdStore(client, "/tls")
        lead(client, store)
        store.write_rows([encode_job(_formed_job("secure"))])
        assert [r["name"] for r in store.load_jobs()] == ["secure"]
        client.close()
        # Without a client certificate etcd refuses the connection.
        anonymous = EtcdClient(EtcdSettings(cluster.url("tls"), cacert=tls.ca), timeout=1.0)
        with pytest.raises(StoreUnavailableError, match=r"^etcd at .* could not read"):
            EtcdStore(anonymous, "/tls").load_jobs()
        anonymous.close()

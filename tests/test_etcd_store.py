"""The state stores against one contract (SQLite and etcd pass the same tests), etcd's fencing,
and the ``--store`` settings' validation. etcd tests run a real three-member cluster: one for the
module, a test's own where it kills members or turns on auth or TLS."""

from __future__ import annotations

import base64
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sarcomm.common.errors import (
    InvalidArgumentError,
    LeadershipLostError,
    StoreLimitError,
    StoreUnavailableError,
)
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.ha.leadership import LeaderRecord
from sarcomm.coordinator.storage import etcd_client, etcd_store
from sarcomm.coordinator.storage.etcd_client import EtcdClient
from sarcomm.coordinator.storage.etcd_config import EtcdSettings, parse_store_url
from sarcomm.coordinator.storage.etcd_store import EtcdStore
from sarcomm.coordinator.storage.records import job_record, load_state
from sarcomm.coordinator.storage.store import JobRow, SqliteStore, StateStore, encode_job
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


def test_a_store_never_goes_back_to_an_older_generation_of_a_job(any_store: StateStore) -> None:
    """A job's last change of an ended generation can reach the writer after (or together with)
    the generation that followed it: the older record is not written over the newer one."""
    first = _formed_job("alpha")
    second = {**first, "generation": 2}
    third = {**first, "generation": 3}
    any_store.write_rows([encode_job(second)])
    any_store.write_rows([encode_job({**first, "state": "RESTARTED"})])
    any_store.write_rows([encode_job(third), encode_job({**second, "state": "RESTARTED"})])
    (loaded,) = any_store.load_jobs()
    assert (loaded["generation"], loaded["state"]) == (3, "RUNNING")
    assert any_store.last_generations() == {"alpha": 3}


def test_sqlite_keeps_one_row_per_job_the_newest_generation(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    store = SqliteStore(path)
    try:
        first, other = _formed_job("alpha"), _formed_job("beta")
        store.write_rows([encode_job(first), encode_job(other)])
        store.write_rows([encode_job({**first, "generation": 2})])
        store.write_rows([encode_job(first)])  # late: not written
        reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = reader.execute("SELECT name, generation FROM jobs ORDER BY name").fetchall()
        finally:
            reader.close()
        assert rows == [("alpha", 2), ("beta", 1)]
    finally:
        store.close()


def test_etcd_keeps_one_record_per_job_and_deletes_the_older_generations_chunks(
    module_etcd_cluster: EtcdCluster, etcd_prefix: str
) -> None:
    """Generation numbers do not sort as text ("10" < "2"): only older generations by number
    are deleted, each with its chunks, and a generation older than one stored is not written."""
    client = EtcdClient(EtcdSettings(module_etcd_cluster.url(etcd_prefix)))
    prefix = "/" + etcd_prefix
    store = EtcdStore(client, prefix)

    def keys() -> tuple[list[str], list[str]]:
        heads = [kv.key.decode().removeprefix(f"{prefix}/@jobs/") for kv in
                 client.range_prefix(f"{prefix}/@jobs/".encode(), keys_only=True)]  # fmt: skip
        chunks = sorted({k.split("/")[-3] for k in _chunk_keys(client, prefix)})
        return heads, chunks

    try:
        lead(client, store)
        big = _realistic_job("big", 4096)  # 16 chunks
        store.write_rows([encode_job(big), encode_job(_formed_job("small"))])
        assert keys() == (["big/1", "small/1"], ["1"])
        store.write_rows([encode_job({**big, "generation": 2, "members": []})])
        assert keys() == (["big/2", "small/1"], [])
        store.write_rows([encode_job({**big, "generation": 10})])
        assert keys() == (["big/10", "small/1"], ["10"])
        store.write_rows([encode_job({**big, "generation": 2, "members": [], "state": "RESTARTED"})])
        assert keys() == (["big/10", "small/1"], ["10"])
        # Another leader's store (a take-over) prunes what the first one left, and reads it whole.
        client.txn("stray", [], [etcd_client.put(f"{prefix}/@jobs/big/9".encode(), b"{}")])
        successor = EtcdStore(client, prefix)
        successor.fence(store_fence(client, store))
        successor.write_rows([encode_job({**big, "generation": 10, "state": "FINISHED"})])
        assert keys() == (["big/10", "small/1"], ["10"])
        # A write that lags behind (a leader that knows nothing newer) never removes a newer one.
        laggard = EtcdStore(client, prefix)
        laggard.fence(store_fence(client, store))
        laggard.write_rows([encode_job({**big, "generation": 3, "members": []})])
        assert keys() == (["big/10", "small/1"], ["10"])
        loaded = {r["name"]: r for r in successor.load_jobs()}
        assert (loaded["big"]["state"], len(loaded["big"]["members"])) == ("FINISHED", 4096)
    finally:
        client.close()


def store_fence(client: EtcdClient, store: EtcdStore) -> int:
    """The create revision of ``store``'s leader key: what its leader fences its writes on."""
    (leader,) = client.range_prefix(store.leader_key)
    return int(leader.create_revision)


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
        store.write_rows([encode_job(_formed_job("q"))])  # its stored generations are looked at now
        stopped = etcd_cluster.lose_quorum()
        with pytest.raises(StoreUnavailableError, match=r"^etcd at .* could not write 1 job record"):
            store.write_rows([encode_job(_formed_job("q"))])
        # A job this leader has not written yet: which generations of it are stored is read first.
        with pytest.raises(
            StoreUnavailableError, match=r"^etcd at .* could not read the keys under .*quorum"
        ):
            store.write_rows([encode_job(_formed_job("r"))])
        etcd_cluster.regain_quorum(stopped)
        wait_for(
            lambda: _writes(store, encode_job(_formed_job("q"))),
            20,
            what="writes to succeed with the quorum back",
        )
        assert [r["name"] for r in store.load_jobs()] == ["q"]
    finally:
        client.close()


def _writes(store: EtcdStore, row: JobRow) -> bool:
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
    for ttl in (0, 3601, 10**20):
        with pytest.raises(
            InvalidArgumentError, match=rf"^--leader-ttl {ttl} must be a whole number of seconds in 1..3600"
        ):
            EtcdSettings("etcd://h:1", leader_ttl=ttl)
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


# -- jobs of any size the limits admit; one deployment's keys only ---------------------------------


def _realistic_job(name: str, world: int, per_host: int = 8) -> dict[str, object]:
    """A formed job of ``world`` members as a cluster would bring them: ``per_host`` members per
    Join (each with its own join id), an address of its own per host, every metrics endpoint
    known, a heartbeat stamp set."""
    membership = Membership(liveness_timeout=30.0, clock=FakeClock())
    for host in range(world // per_host):
        ip = f"10.{host >> 16 & 255}.{host >> 8 & 255}.{host & 255}"
        ranks = [None] * per_host
        membership.join(
            spec(f"node{host}", *ranks, job=name, world_size=world, peer=ip, address=ip), f"j{host}"
        )
    job = membership.job(name)
    assert job is not None
    assert job.formed
    for member in job.members:
        member.metrics_address = f"{member.address}:{9400 + member.local_rank}"
        member.last_heartbeat = job.formed + 1.25
    return job_record(job)


def _chunk_keys(client: EtcdClient, prefix: str) -> list[str]:
    return [kv.key.decode() for kv in client.range_prefix(f"{prefix}/@members/".encode(), keys_only=True)]


def test_a_store_keeps_a_32768_member_job_and_restores_it_identically(any_store: StateStore) -> None:
    # ~27 MB of JSON, 2.5 MB compressed: more than etcd takes in one request (1.5 MiB).
    record = _realistic_job("huge", 32768)
    any_store.write_rows([encode_job(record)])
    (loaded,) = any_store.load_jobs()
    assert loaded == json.loads(json.dumps(record))
    (job,) = load_state(any_store).jobs
    assert job_record(job) == loaded
    assert any_store.last_generations() == {"huge": 1}


def test_etcd_keeps_only_the_chunks_of_the_last_write_and_a_write_cut_short_changes_nothing(
    etcd_cluster: EtcdCluster,
) -> None:
    client = EtcdClient(EtcdSettings(etcd_cluster.url("chunks")))
    store = EtcdStore(client, "/chunks")
    try:
        lead(client, store)
        record = _realistic_job("big", 4096)
        store.write_rows([encode_job(record)])
        first = _chunk_keys(client, "/chunks")
        assert len(first) == 16  # 256 members a chunk
        # A write cut short (its leader died between its chunks and its head) left a chunk behind:
        # readers still get the record as it was.
        orphan = "/chunks/@members/big/1/999-1/0"
        client.txn("orphan", [], [etcd_client.put(orphan.encode(), b"[]")])
        (loaded,) = store.load_jobs()
        assert loaded == json.loads(json.dumps(record))
        record["state"] = "FINISHED"
        store.write_rows([encode_job(record)])
        second = _chunk_keys(client, "/chunks")
        assert len(second) == 16
        assert not set(second) & {*first, orphan}
        assert store.load_jobs()[0]["state"] == "FINISHED"
        # Small again (whole in its key): no chunk of it is left.
        record["members"] = record["members"][:8]  # type: ignore[index]
        store.write_rows([encode_job(record)])
        assert _chunk_keys(client, "/chunks") == []
        assert store.load_jobs() == [json.loads(json.dumps(record))]
    finally:
        client.close()


def test_a_deployment_never_sees_nor_deletes_the_keys_of_one_nested_in_its_prefix(
    etcd_cluster: EtcdCluster,
) -> None:
    client = EtcdClient(EtcdSettings(etcd_cluster.url()))
    outer, inner = EtcdStore(client, "/a"), EtcdStore(client, "/a/jobs/team")
    try:
        lead(client, outer)
        lead(client, inner)
        # The same names on both, one a large (chunked) job, each written twice (the second write
        # deletes the chunks of the first); a job of the inner one named like the outer's key space.
        for _ in range(2):
            outer.write_rows([encode_job(_realistic_job("x", 2048)), encode_job(_formed_job("team"))])
            inner.write_rows([encode_job(_realistic_job("x", 2048)), encode_job(_formed_job("jobs"))])
        # Keys of the first layout: an old outer's job (read), an old inner's keys (not its).
        old = {**_formed_job("old", 1), "generation": 4}
        client.txn("old layout", [], [
            etcd_client.put(b"/a/jobs/old/4", json.dumps(old).encode()),
            etcd_client.put(b"/a/jobs/team/jobs/y/1", json.dumps(_formed_job("y", 1)).encode()),
            etcd_client.put(b"/a/jobs/team/7/jobs/z/1", json.dumps(_formed_job("z", 1)).encode()),
        ])  # fmt: skip
        assert sorted(r["name"] for r in outer.load_jobs()) == ["old", "team", "x"]
        assert outer.last_generations() == {"old": 4, "team": 1, "x": 1}
        assert sorted(r["name"] for r in inner.load_jobs()) == ["jobs", "x", "y"]
        assert {len(r["members"]) for r in inner.load_jobs() if r["name"] == "x"} == {2048}
    finally:
        client.close()


def test_a_record_etcd_can_never_take_is_refused_alone_naming_the_limit(
    etcd_cluster: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = EtcdClient(EtcdSettings(etcd_cluster.url("limits")))
    store = EtcdStore(client, "/limits")
    try:
        lead(client, store)
        # One member larger than a request may be (random text does not compress).
        huge = _realistic_job("huge", 2048)
        huge["members"][0]["reason"] = base64.b64encode(os.urandom(1536 * 1024)).decode()  # type: ignore[index]
        with pytest.raises(StoreLimitError) as refused:
            store.write_rows([encode_job(huge), encode_job(_formed_job("small"))])
        assert set(refused.value.refused) == {("huge", 1)}
        assert "more than one etcd request may carry (1048576)" in refused.value.refused[("huge", 1)]
        assert [r["name"] for r in store.load_jobs()] == ["small"]
        assert _chunk_keys(client, "/limits") == []  # its chunks before the one too large: none kept
        # A record over the most one job may take in etcd.
        monkeypatch.setattr(etcd_store, "MAX_RECORD_BYTES", 100_000)
        with pytest.raises(StoreLimitError, match=r"more than 100000 bytes compressed, the most one job"):
            store.write_rows([encode_job(_realistic_job("big", 4096))])
    finally:
        client.close()

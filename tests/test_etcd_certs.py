"""deploy/kubernetes/ha/etcd-certs.sh makes certificates a real etcd serves and checks with: a
one-member etcd on loopback with the script's peer certificate and CA and ``--client-cert-auth``
(as ha/etcd.yaml runs it) answers a coordinator's client with the script's client certificate,
and refuses one without."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sarcomm.common.errors import StoreUnavailableError
from sarcomm.coordinator.storage.etcd_client import EtcdClient
from sarcomm.coordinator.storage.etcd_config import EtcdSettings
from tests.etcd_cluster import ETCD_MISSING, EtcdCluster

SCRIPT = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "ha" / "etcd-certs.sh"

pytestmark = [pytest.mark.etcd, pytest.mark.skipif(bool(ETCD_MISSING), reason=ETCD_MISSING)]


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    out = tmp_path / "certs"
    subprocess.run(["bash", str(SCRIPT), "ml", str(out)], check=True, capture_output=True, timeout=60)
    return out


@pytest.fixture
def tls_etcd(tmp_path: Path, certs: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(
        tmp_path / "etcd", size=1, client_tls=(certs / "ca.crt", certs / "peer.crt", certs / "peer.key")
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


def test_etcd_admits_the_coordinators_certificate_and_refuses_a_client_without_one(
    tls_etcd: EtcdCluster, certs: Path
) -> None:
    url = tls_etcd.url("sarcomm")
    client = EtcdClient(
        EtcdSettings(url, cacert=certs / "ca.crt", cert=certs / "client.crt", key=certs / "client.key")
    )
    try:
        revision, size = client.status()
        assert revision >= 1
        assert size > 0
        # etcd's quota, read from its /metrics over the same TLS (what the store's gauges show).
        assert client.quota_bytes() == 2 * 1024**3
    finally:
        client.close()
    anonymous = EtcdClient(EtcdSettings(url, cacert=certs / "ca.crt"), timeout=2)
    try:
        with pytest.raises(StoreUnavailableError):
            anonymous.status()
    finally:
        anonymous.close()
    # The certificate names the members by the names the coordinators dial (--store).
    names = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(certs / "peer.crt")],
        capture_output=True, text=True, check=True, timeout=10,
    ).stdout  # fmt: skip
    for i in range(3):
        assert f"DNS:sarcomm-etcd-{i}.sarcomm-etcd," in names
        assert f"DNS:sarcomm-etcd-{i}.sarcomm-etcd.ml.svc," in names

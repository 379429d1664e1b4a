"""Test certificates: a CA, the coordinator's certificate, good and rogue client certificates."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme

from sarcomm.common.tls import ClientTls


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    # Signed by another CA: neither side trusts these.
    rogue_ca: Path
    rogue_cert: Path
    rogue_key: Path

    def server_args(self, mutual: bool = False) -> list[str]:
        args = ["--tls-cert", str(self.server_cert), "--tls-key", str(self.server_key)]
        return [*args, "--tls-client-ca", str(self.ca)] if mutual else args

    def client(self, *, cert: bool = True) -> ClientTls:
        return ClientTls(self.ca, self.client_cert if cert else None, self.client_key if cert else None)

    def http_context(self, *, cert: bool = True) -> ssl.SSLContext:
        return self.client(cert=cert).ssl_context()


def make_tls_files(directory: Path) -> TlsFiles:
    ca, rogue = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("worker.example")
    rogue_client = rogue.issue_cert("worker.example")
    files = TlsFiles(*(directory / name for name in (
        "ca.pem", "server.pem", "server.key", "client.pem", "client.key", "rogue-ca.pem", "rogue.pem",
        "rogue.key",
    )))  # fmt: skip
    ca.cert_pem.write_to_path(str(files.ca))
    server.cert_chain_pems[0].write_to_path(str(files.server_cert))
    server.private_key_pem.write_to_path(str(files.server_key))
    client.cert_chain_pems[0].write_to_path(str(files.client_cert))
    client.private_key_pem.write_to_path(str(files.client_key))
    rogue.cert_pem.write_to_path(str(files.rogue_ca))
    rogue_client.cert_chain_pems[0].write_to_path(str(files.rogue_cert))
    rogue_client.private_key_pem.write_to_path(str(files.rogue_key))
    return files

"""Refusals that name the setting as the user wrote it, with the value and the rule: the TLS
variables under torchrun and the library (not sar-worker's flags), ``/v1/jobs?job=`` (the rule
gRPC's ListJobs applies, 400 instead of an empty list), and the metrics variables under torchrun
(refused before any worker starts, or, what only a worker can find, costing only its endpoint).
In process: a coordinator on port 0. (sar-worker's bounds and exit status: test_agent_cli.py.)"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.worker.agent import cli
from sarcomm.worker.launch_env import client_tls_setting
from sarcomm.worker.library.services import start_rank_services
from tests.coordinator_fixture import InProcessCoordinator, in_process_coordinator
from tests.helpers import FakeClock

RULE = "must be 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"


def test_torchrun_names_the_tls_variable_not_a_flag_it_lacks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SARCOMM_TLS_CA", "/missing")
    params = RendezvousParameters("sarcomm", "127.0.0.1:1", "ok", 1, 1)
    with pytest.raises(ValueError, match=r"^sarcomm rendezvous: ") as caught:
        get_rendezvous_handler(params)
    assert str(caught.value) == (
        "sarcomm rendezvous: SARCOMM_TLS_CA '/missing' must be a readable PEM file: No such file or directory"
    )
    # The library (sar.init()) reads the same variables, with the same names in its refusals.
    cert = tmp_path / "cert.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(InvalidArgumentError) as refused:
        client_tls_setting({"SARCOMM_TLS_CERT": str(cert)})
    assert str(refused.value).startswith(
        f"SARCOMM_TLS_CERT '{cert}' and SARCOMM_TLS_KEY (not given) must be given together"
    )


@pytest.fixture
async def coord() -> AsyncIterator[InProcessCoordinator]:
    async with in_process_coordinator(FakeClock()) as coordinator:
        yield coordinator


@pytest.mark.parametrize("name", ["x" * 5000, "a%20b", "..%2Fx"], ids=["5000-chars", "space", "dotdot-slash"])
async def test_v1_jobs_refuses_a_malformed_job_name_with_the_rule_of_list_jobs(
    coord: InProcessCoordinator, name: str
) -> None:
    url = f"http://127.0.0.1:{coord.coordinator.http_port}/v1/jobs?job={name}"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        status, text = response.status, await response.text()
    assert status == 400, text
    assert text.startswith("job "), text
    assert text.endswith(RULE), text
    # gRPC's ListJobs, the same rule in the same words.
    async with coord.client() as client:
        with pytest.raises(InvalidArgumentError) as caught:
            await client.list_jobs(name.replace("%20", " ").replace("%2F", "/"))
    assert str(caught.value).endswith(RULE)
    assert str(caught.value).split(" ", 1)[0] == "job"


async def test_v1_jobs_answers_a_well_formed_name_it_does_not_know_with_no_jobs(
    coord: InProcessCoordinator,
) -> None:
    url = f"http://127.0.0.1:{coord.coordinator.http_port}/v1/jobs"
    async with aiohttp.ClientSession() as session:
        for query in ("?job=nothing-here", "?job=", ""):
            async with session.get(url + query) as response:
                assert response.status == 200
                assert (await response.json())["jobs"] == []


# -- a bad metrics variable under torchrun: refused up front, or it costs only the endpoint ---------


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("SAR_METRICS_PORT", "abc", "SAR_METRICS_PORT='abc' must be an integer in -1..65535 "),
        ("SAR_METRICS_PORT", "70000", "SAR_METRICS_PORT='70000' must be an integer in -1..65535 "),
        ("SAR_METRICS_HOST", "not-an-ip", "SAR_METRICS_HOST='not-an-ip' must be an IP address of this host "),
    ],
)
def test_torchrun_refuses_a_malformed_metrics_variable_before_any_worker_starts(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    monkeypatch.setenv(variable, value)
    params = RendezvousParameters("sarcomm", "127.0.0.1:1", "ok", 1, 1)
    with pytest.raises(ValueError, match=r"^sarcomm rendezvous: ") as caught:
        get_rendezvous_handler(params)
    assert str(caught.value).startswith(f"sarcomm rendezvous: {message}"), caught.value
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"SAR_METRICS_PORT": "65535", "LOCAL_RANK": "1"},
            "SAR_METRICS_PORT=65535 gives local rank 1 port 65536, beyond 65535",
        ),
        ({"SAR_METRICS_PORT": "abc", "LOCAL_RANK": "0"}, "SAR_METRICS_PORT='abc' must be an integer"),
        ({"SAR_METRICS_HOST": "not-an-ip", "LOCAL_RANK": "0"}, "SAR_METRICS_HOST='not-an-ip' must be an IP"),
    ],
    ids=["port-plus-local-rank", "port", "host"],
)
def test_a_worker_with_a_bad_metrics_variable_trains_on_without_its_endpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, env: dict[str, str], message: str
) -> None:
    """What only the worker can find (its local rank's port): one line, no endpoint, no raise."""
    worker_env = {"SAR_ENDPOINTS_DIR": str(tmp_path), "RANK": "1", "SAR_GENERATION": "1", **env}
    with caplog.at_level(logging.ERROR, logger="sarcomm.worker.library.services"):
        start_rank_services(worker_env)
    lines = [r.getMessage() for r in caplog.records if r.name == "sarcomm.worker.library.services"]
    assert len(lines) == 1, lines
    assert message in lines[0], lines
    assert lines[0].endswith("Training goes on without the /metrics endpoint."), lines
    assert list(tmp_path.iterdir()) == []  # nothing noted for /sd


def test_sar_worker_names_the_tls_variable_it_fell_back_to_and_the_flag_it_was_given() -> None:
    argv = ["--coord", "127.0.0.1:1", "--job", "j", "--world-size", "1"]
    with pytest.raises(InvalidArgumentError) as caught:
        cli.parse([*argv, "--", "true"], {"SARCOMM_TLS_CA": "/missing"})
    assert str(caught.value).startswith("SARCOMM_TLS_CA '/missing' must be a readable PEM file")
    with pytest.raises(InvalidArgumentError) as caught:
        cli.parse([*argv, "--tls-ca", "/missing", "--", "true"], {"SARCOMM_TLS_CA": "/elsewhere"})
    assert str(caught.value).startswith("--tls-ca '/missing' must be a readable PEM file")

"""Refusals that name the setting as the user wrote it, with the value and the rule: the TLS
variables under torchrun and the library (not sar-worker's flags), and ``/v1/jobs?job=`` (the rule
gRPC's ListJobs applies, 400 instead of an empty list). In process: a coordinator on port 0.
(sar-worker's bounds and exit status: tests/test_agent_cli.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from sarcomm.common.errors import InvalidArgumentError
from sarcomm.worker.launch_env import client_tls_setting
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

"""deploy/kubernetes/, checked offline: the schemas, then the product.

No cluster runs here. Every object is validated against Kubernetes' own JSON schemas, which the
dev extra's kubernetes-validate carries (strict: an unknown field is an error, as with `kubectl
apply`), and the PyTorchJob against the v1 API models of Kubeflow's training SDK (the dev extra's
kubeflow-training, generated like the training-operator's CRD from its Go types). Then what the
manifests name is held against sarcomm itself: the images deploy/docker builds; every flag and
SARCOMM_* variable through the programs' own parsers and `--help` (in process: no process is
started); the ports, probes and paths against what the coordinator serves; the Services against
the pods they select. tests/kube_manifests.py reads the manifests.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import io
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from sarcomm.common.addresses import parse_address
from sarcomm.common.errors import SarcommError
from sarcomm.coordinator import cli as coordinator_cli
from sarcomm.coordinator.api.http import PUBLIC_PATHS
from sarcomm.coordinator.api.validation import job_name
from sarcomm.coordinator.config import CoordinatorConfig
from sarcomm.coordinator.server import SERVICE_NAME
from sarcomm.coordinator.storage.etcd_config import parse_store_url
from sarcomm.worker.agent import cli as worker_cli
from sarcomm.worker.agent.decisions import EXIT_SPAWN_FAILED
from sarcomm.worker.agent.runner import EXIT_USAGE
from tests import kube_manifests as kube
from tests.kube_manifests import Container, Manifest

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
try:
    importlib.metadata.version(kube.KUBEFLOW_SDK)
    KUBEFLOW_MISSING = ""
except importlib.metadata.PackageNotFoundError:
    KUBEFLOW_MISSING = f"needs {kube.KUBEFLOW_SDK} (pip install -e '.[dev]')"
needs_kubeflow = pytest.mark.skipif(bool(KUBEFLOW_MISSING), reason=KUBEFLOW_MISSING)

#: The oldest Kubernetes deploy/kubernetes/README.md promises, and the newest the dev extra's
#: kubernetes-validate (>= 1.37) ships.
KUBERNETES_VERSIONS = ("1.29", "1.37")
BUILD_SCRIPT = kube.ROOT / "deploy" / "docker" / "build-images.sh"
#: The kustomizations that apply a coordinator: the default (SQLite) and the etcd replicas.
TREES = ("", "ha")
#: torchrun's rendezvous settings the sarcomm plugin reads from --rdzv-conf (issue 21).
RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout", "read_timeout")
#: The flags of a client's token and TLS files: torchrun's plugin reads them as SARCOMM_<FLAG>.
CLIENT_SECURITY_FLAGS = ("--token-file", "--tls-ca", "--tls-cert", "--tls-key")
#: sar-coordinator's settings that name a file (a secret: it must come from a Secret's volume).
FILE_SETTINGS = (
    "token_file", "tls_cert", "tls_key", "tls_client_ca",
    "etcd_cacert", "etcd_cert", "etcd_key", "etcd_password_file",
)  # fmt: skip
#: The names Kubernetes gives a Service or a PyTorchJob (DNS-1035 labels).
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


def env_name(flag: str) -> str:
    """The SARCOMM_<FLAG> rule both programs follow."""
    return "SARCOMM_" + flag.lstrip("-").replace("-", "_").upper()


@cache
def help_text(program: str) -> str:
    """``sar-coordinator --help`` (and ``status --help``) or ``sar-worker --help``, run in process."""
    runs: list[tuple[Callable[[list[str]], int], list[str]]] = (
        [(lambda a: coordinator_cli.main(a, env={}), a) for a in (["--help"], ["status", "--help"])]
        if program == "sar-coordinator"
        else [(worker_cli.main, ["--help"])]
    )
    out = io.StringIO()
    for main, argv in runs:
        with contextlib.redirect_stdout(out):
            assert main(argv) == 0
    return out.getvalue()


def flags_of(program: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", help_text(program)))


def variables_of(program: str) -> set[str]:
    return set(re.findall(r"env\s+(SARCOMM_[A-Z0-9_]+)", help_text(program)))


def running(program: str, objects: list[Manifest] | None = None) -> list[Container]:
    return [c for c in kube.containers(objects) if c.program()[0] == program]


def coordinator_of(tree: str) -> Container:
    (container,) = running("sar-coordinator", kube.tree(tree))
    return container


def host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def only(manifests: list[Manifest], kind: str) -> Manifest:
    (found,) = [m for m in manifests if m.kind == kind]
    return found


def kubernetes_errors(doc: dict[str, Any], version: str) -> list[str]:
    """What Kubernetes ``version``'s schema says against ``doc``; a PyTorchJob is checked by its
    pod template (as a PodTemplate) here, and whole by :func:`pytorchjob_problems`."""
    if doc["kind"] == "PyTorchJob":
        template = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{'.'.join(map(str, error.path))}: {error.message}"]
    return []


# -- schemas ---------------------------------------------------------------------------------------


def test_every_manifest_is_applied_by_a_kustomization_or_is_an_example() -> None:
    applied = {m.path for tree in TREES for m in kube.tree(tree)}
    assert {m.path for m in kube.manifests()} - applied == {
        "examples/indexed-job.yaml",
        "examples/pytorchjob.yaml",
    }
    for tree in TREES:
        names = [(m.kind, m.name) for m in kube.tree(tree)]
        assert len(names) == len(set(names)), f"{tree or 'the top'}: an object twice: {names}"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version: str) -> None:
    problems = [f"{m}: {e}" for m in kube.manifests() for e in kubernetes_errors(m.doc, version)]
    assert problems == []


def pytorchjob_problems(doc: dict[str, Any]) -> list[str]:
    """``doc`` against Kubeflow's v1 API models; the Kubernetes types in it (the job's metadata, the
    pod template) against Kubernetes' schemas."""
    version = KUBERNETES_VERSIONS[-1]
    template_of = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
    outside: dict[str, Callable[[Any], list[str]]] = {
        "V1ObjectMeta": lambda meta: kubernetes_errors(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}, version
        ),
        "V1PodTemplateSpec": lambda pod: kubernetes_errors(template_of | {"template": pod}, version),
    }
    return kube.kubeflow_problems(doc, "KubeflowOrgV1PyTorchJob", "PyTorchJob", outside)


@needs_kubeflow
def test_pytorchjob_validates_against_kubeflow_api_models() -> None:
    job = only(kube.manifests(), "PyTorchJob")
    assert job.doc["apiVersion"] == "kubeflow.org/v1"
    assert pytorchjob_problems(job.doc) == []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_schemas_reject_a_misspelt_field(version: str) -> None:
    statefulset = copy.deepcopy(only(kube.tree(""), "StatefulSet").doc)
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    container["livenesProbe"] = container.pop("livenessProbe")
    (error,) = kubernetes_errors(statefulset, version)
    assert error.startswith("spec.template.spec.containers.0: ")
    assert "'livenesProbe' was unexpected" in error


@needs_kubeflow
def test_kubeflow_models_reject_a_misspelt_field_and_a_wrong_type() -> None:
    job = copy.deepcopy(only(kube.manifests(), "PyTorchJob").doc)
    policy = job["spec"]["elasticPolicy"]
    policy["rdzv_backend"] = policy.pop("rdzvBackend")
    policy["rdzvPort"] = "50051"
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["imag"] = "x"
    problems = pytorchjob_problems(job)
    assert [p.partition(" (")[0] for p in problems[:2]] == [
        "PyTorchJob.spec.elasticPolicy: unknown field 'rdzv_backend'",
        "PyTorchJob.spec.elasticPolicy.rdzvPort: '50051' is not of type int",
    ]
    assert len(problems) == 3
    assert "'imag' was unexpected" in problems[2]


# -- images ----------------------------------------------------------------------------------------


def built_images() -> dict[str, str]:
    """The images deploy/docker/build-images.sh builds, by name: {"sarcomm": "sarcomm:latest", ...}."""
    found = re.findall(r'^\w*IMAGE="\$\{SARCOMM_\w*IMAGE:-([^}]+)\}"$', BUILD_SCRIPT.read_text(), re.M)
    return {image.rpartition(":")[0]: image for image in found}


def pinned_images() -> dict[str, str]:
    """What deploy/kubernetes must name: each image build-images.sh builds and tags with the
    project's version too (``docker tag "$IMAGE" "sarcomm:$PROJECT_VERSION"``), at that version,
    by name: {"sarcomm": "sarcomm:0.1.0", ...}."""
    script = BUILD_SCRIPT.read_text()
    defaults = dict(re.findall(r'^(\w*IMAGE)="\$\{SARCOMM_\w*IMAGE:-([^}]+)\}"$', script, re.M))
    version = importlib.metadata.version("sarcomm")
    pinned = {}
    for variable, name in re.findall(r'docker tag "\$(\w+)" "([\w-]+):\$PROJECT_VERSION"', script):
        assert defaults[variable].rpartition(":")[0] == name, (variable, name)
        pinned[name] = f"{name}:{version}"
    return pinned


def test_images_are_those_deploy_docker_builds() -> None:
    built = built_images()
    assert built["sarcomm"] in (kube.ROOT / "docker-compose.yml").read_text()
    pinned = pinned_images()
    assert set(pinned) == {"sarcomm", "sarcomm-etcd"}, f"{BUILD_SCRIPT.name} must tag each with the version"
    used = {c.spec["image"] for c in kube.containers()}
    assert used <= set(pinned.values()), f"not pinned to the version: {used - set(pinned.values())}"
    for tree in TREES:
        path = f"{tree}/{kube.KUSTOMIZATION}" if tree else "sqlite/kustomization.yaml"
        (own,) = [m for m in kube.kustomizations() if m.path == path]
        in_tree = {c.spec["image"].rpartition(":")[0] for c in kube.containers(kube.tree(tree))}
        entries = {i["name"]: i for i in own.doc["images"]}
        assert set(entries) == in_tree, f"{path}: `images` must name each image its manifests use"
        for name, entry in entries.items():
            assert f"{name}:{entry['newTag']}" == pinned[name], f"{path}: {entry}"


def test_no_image_floats_on_latest() -> None:
    for path in sorted(kube.KUBERNETES.rglob("*.yaml")):
        text = path.read_text()
        found = re.findall(r"(?m)^\s*(?:image|newTag):\s*\"?(\S*?)\"?$", text)
        assert found or "image" not in text, path
        for value in found:
            moving = value in ("latest", "local") or value.endswith((":latest", ":local"))
            assert not moving, f"{path.relative_to(kube.ROOT)}: {value} is a moving tag: pin the version"


# -- the coordinator -------------------------------------------------------------------------------


def coordinator_problems(container: Container, scratch: Path) -> list[str]:
    """What is wrong with how ``container`` runs sar-coordinator: flags and variables it does not
    have, settings it refuses, files on no volume, ports and probes that miss what it serves."""
    _, args, unset = container.program()
    problems = [
        f"flag {a} is not in sar-coordinator --help"
        for a in args
        if a.startswith("--") and a.partition("=")[0] not in flags_of("sar-coordinator")
    ]
    manifest_env = container.env()
    problems += [
        f"variable {v} is no SARCOMM_<FLAG> of sar-coordinator"
        for v in manifest_env
        if v.startswith("SARCOMM_") and v not in variables_of("sar-coordinator")
    ]
    env = {k: v for k, v in kube.image_environment().items() if k not in unset} | manifest_env
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parsed = coordinator_cli.parse_args(args, env)
    except (SystemExit, SarcommError):
        return [*problems, f"sar-coordinator refuses its arguments: {stderr.getvalue().strip()}"]
    for field in FILE_SETTINGS:
        path = getattr(parsed, field)
        if path is not None:
            volume = container.volume_at(str(path)) or {}
            if "secret" not in volume and "projected" not in volume:
                problems.append(f"{field} {path} is not on a Secret volume: {volume}")
            (scratch / field).write_text("a-token\n")
            setattr(parsed, field, scratch / field)
    if parsed.state is not None and "persistentVolumeClaimTemplate" not in (
        container.volume_at(str(parsed.state)) or {}
    ):
        problems.append(f"--state {parsed.state} is not on a PersistentVolumeClaim")
    try:
        config = coordinator_cli.config_from_args(parsed)
    except SarcommError as error:
        return [*problems, f"sar-coordinator refuses its settings: {error}"]
    return problems + _serving_problems(container, config)


def _serving_problems(container: Container, config: CoordinatorConfig) -> list[str]:
    """Ports, probes and annotations against what ``config`` makes the coordinator serve."""
    problems = []
    grpc, http = host_port(config.listen)[1], host_port(config.http)[1]
    defaults = coordinator_cli.parse_args([], {})
    if (grpc, http) != (host_port(defaults.listen)[1], host_port(defaults.http)[1]):
        problems.append(f"ports {grpc}, {http} are not the defaults {defaults.listen}, {defaults.http}")
    if container.ports() != {"grpc": grpc, "http": http}:
        problems.append(f"container ports {container.ports()} are not grpc {grpc} and http {http}")
    # On etcd a standby's Coordinator service is NOT_SERVING by design: only "" says "it runs".
    service = "" if config.store is not None else SERVICE_NAME
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.spec.get(kind)
        if probe is None:
            problems.append(f"no {kind}")
        elif "grpc" in probe and (probe["grpc"]["port"], probe["grpc"].get("service")) != (grpc, service):
            problems.append(f"{kind} {probe['grpc']} must ask port {grpc} about service {service!r}")
        elif "httpGet" in probe and (
            container.port(probe["httpGet"]["port"]) != http or probe["httpGet"]["path"] not in PUBLIC_PATHS
        ):
            problems.append(f"{kind} {probe['httpGet']} is not one of {sorted(PUBLIC_PATHS)} on {http}")
    notes = container.pod["metadata"].get("annotations", {})
    if (notes.get("prometheus.io/port"), notes.get("prometheus.io/path")) != (str(http), "/metrics"):
        problems.append(f"prometheus.io annotations {notes} must name {http} and /metrics")
    if config.store is not None:
        advertised = host_port(config.advertise) if config.advertise else None
        if advertised is None or advertised[1] != grpc or parse_address(advertised[0]) is None:
            problems.append(f"--advertise {config.advertise!r} must be the pod's IP and port {grpc}")
    return problems


@pytest.mark.parametrize("tree", TREES)
def test_coordinator_runs_with_what_sar_coordinator_has(tree: str, tmp_path: Path) -> None:
    assert coordinator_problems(coordinator_of(tree), tmp_path) == []


def _drop_flag(container: dict[str, Any], flag: str) -> None:
    where = container["args"].index(flag)
    del container["args"][where : where + 2]


@pytest.mark.parametrize(
    ("tree", "change", "problem"),
    [
        ("", lambda c: c["args"].append("--heartbeat-intervall=2"), "flag --heartbeat-intervall=2 is not"),
        ("", lambda c: c["env"].append({"name": "SARCOMM_HEARTBEAT", "value": "1"}), "SARCOMM_HEARTBEAT is"),
        ("", lambda c: c["volumeMounts"].pop(0), "--state /var/lib/sarcomm/state.sqlite is not on a Persis"),
        ("", lambda c: c["env"][0].update(value="/tmp/token"), "token_file /tmp/token is not on a Secret"),
        ("", lambda c: c["ports"][0].update(containerPort=50052), "container ports"),
        ("", lambda c: c["readinessProbe"]["grpc"].update(service=""), "readinessProbe"),
        ("", lambda c: c["livenessProbe"]["httpGet"].update(path="/v1/jobs"), "livenessProbe"),
        ("ha", lambda c: c["readinessProbe"]["grpc"].update(service=SERVICE_NAME), "readinessProbe"),
        ("ha", lambda c: _drop_flag(c, "--advertise"), "--advertise '' must be the pod's IP"),
        ("ha", lambda c: c.update(command=["sar-coordinator"]), "refuses its settings: --store etcd://"),
    ],
)
def test_coordinator_check_names_what_is_wrong(
    tree: str, change: Callable[[dict[str, Any]], object], problem: str, tmp_path: Path
) -> None:
    original = coordinator_of(tree)
    pod = copy.deepcopy(original.pod)
    change(pod["spec"]["containers"][0])
    broken = Container(original.workload, pod, pod["spec"]["containers"][0])
    found = coordinator_problems(broken, tmp_path)
    assert any(problem in p for p in found), found


def test_coordinator_store_names_the_etcd_members_of_its_tree() -> None:
    objects = kube.tree("ha")
    _, args, _ = coordinator_of("ha").program()
    endpoints, _ = parse_store_url(args[args.index("--store") + 1])
    (etcd,) = running("etcd", objects)
    spec = etcd.workload.doc["spec"]
    members = {
        (f"{etcd.workload.name}-{i}.{spec['serviceName']}", etcd.port("client"))
        for i in range(spec["replicas"])
    }
    assert set(endpoints) == members


# -- etcd: TLS, client certificates, the NetworkPolicy ---------------------------------------------


def etcd_flags(container: Container) -> dict[str, str]:
    """etcd's ``--flag=value`` arguments (``--switch`` alone: "true")."""
    _, args, _ = container.program()
    flags = {}
    for arg in args:
        name, equals, value = arg.partition("=")
        flags[name] = value if equals else "true"
    return flags


def secret_of(container: Container, path: str) -> str:
    """The name of the Secret whose volume holds ``path`` in ``container``."""
    volume = container.volume_at(path) or {}
    assert "secret" in volume, f"{container}: {path} is not on a Secret volume"
    return str(volume["secret"]["secretName"])


def test_etcd_speaks_tls_only_and_admits_only_client_certificates_of_its_ca() -> None:
    (etcd,) = running("etcd", kube.tree("ha"))
    flags = etcd_flags(etcd)
    for urls in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls",
                 "--initial-advertise-peer-urls"):  # fmt: skip
        assert all(url.startswith("https://") for url in flags[urls].split(",")), (urls, flags[urls])
    peers = [member.partition("=")[2] for member in flags["--initial-cluster"].split(",")]
    assert len(peers) == 3, peers
    assert all(url.startswith("https://") for url in peers), peers
    assert flags["--client-cert-auth"] == "true"
    assert flags["--peer-client-cert-auth"] == "true"
    secrets = {
        secret_of(etcd, flags[flag])
        for flag in ("--cert-file", "--key-file", "--trusted-ca-file", "--peer-cert-file", "--peer-key-file",
                     "--peer-trusted-ca-file")
    }  # fmt: skip
    assert secrets == {"sarcomm-etcd-peer"}
    # What is plain HTTP is /health and /metrics only, where the probes ask.
    metrics = flags["--listen-metrics-urls"]
    assert metrics.startswith("http://")
    assert metrics.endswith(f":{etcd.port('metrics')}")
    assert etcd.spec["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    # Auto-compaction on, as in every etcd configuration sarcomm ships (issue 31).
    assert flags["--auto-compaction-mode"] == "periodic"
    assert flags["--auto-compaction-retention"]


def test_coordinator_reaches_etcd_with_a_client_certificate_of_its_own(tmp_path: Path) -> None:
    coordinator = coordinator_of("ha")
    env = coordinator.env()
    files = {env[v] for v in ("SARCOMM_ETCD_CACERT", "SARCOMM_ETCD_CERT", "SARCOMM_ETCD_KEY")}
    assert {secret_of(coordinator, path) for path in files} == {"sarcomm-etcd-client"}
    # sar-coordinator takes them (TLS on, with a client certificate): parsed by its own CLI.
    _, args, unset = coordinator.program()
    environment = {k: v for k, v in kube.image_environment().items() if k not in unset} | env
    parsed = coordinator_cli.parse_args(args, environment)
    for field in FILE_SETTINGS:
        if getattr(parsed, field) is not None:
            (tmp_path / field).write_text("a-token\n")
            setattr(parsed, field, tmp_path / field)
    store = coordinator_cli.config_from_args(parsed).store
    assert store is not None
    assert store.tls
    assert store.cert is not None


def test_etcd_certificates_script_names_each_member_the_coordinators_dial() -> None:
    script = (kube.KUBERNETES / "ha" / "etcd-certs.sh").read_text()
    assert "sarcomm-etcd-peer" in script
    assert "sarcomm-etcd-client" in script
    assert "sarcomm-etcd-$i.$domain" in script
    assert "extendedKeyUsage=serverAuth,clientAuth" in script
    (etcd,) = running("etcd", kube.tree("ha"))
    assert etcd.workload.doc["spec"]["replicas"] == 3
    assert "SARCOMM_ETCD_MEMBERS:-3" in script
    # Nothing private is committed: the script makes keys where it is told, never in the tree.
    assert not list(kube.ROOT.joinpath("deploy").rglob("*.key")), "a private key is in deploy/"


def test_network_policy_admits_only_coordinators_to_etcd_and_members_to_peers() -> None:
    objects = kube.tree("ha")
    (policy,) = [m for m in objects if m.kind == "NetworkPolicy"]
    spec = policy.doc["spec"]
    (etcd,) = running("etcd", objects)
    coordinator = coordinator_of("ha")

    def selects(selector: dict[str, Any], container: Container) -> bool:
        labels = container.pod["metadata"]["labels"]
        return all(labels.get(k) == v for k, v in selector["matchLabels"].items())

    assert selects(spec["podSelector"], etcd)
    assert not selects(spec["podSelector"], coordinator)
    assert spec["policyTypes"] == ["Ingress"]
    admitted: dict[int, set[str]] = {}
    for rule in spec["ingress"]:
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}, f"admit pods of this namespace only: {peer}"
        who = {c.name for c in (etcd, coordinator) if selects(peer["podSelector"], c)}
        for port in rule["ports"]:
            admitted.setdefault(etcd.port(port["port"]), set()).update(who)
    assert admitted == {etcd.port("client"): {"coordinator"}, etcd.port("peer"): {"etcd"}}


# -- Services, links, the token --------------------------------------------------------------------


@pytest.mark.parametrize("tree", TREES)
def test_services_select_pods_and_ports_of_their_tree(tree: str) -> None:
    objects = kube.tree(tree)
    workloads = [m for m in objects if kube.pod_template(m) is not None]
    services = {m.name: m for m in objects if m.kind == "Service"}
    for service in services.values():
        selector = service.doc["spec"]["selector"]
        chosen = [w for w in workloads if selector.items() <= kube.pod(w)["metadata"]["labels"].items()]
        assert chosen, f"{service}: selects no pod"
        for port in service.doc["spec"]["ports"]:
            for container in kube.containers(chosen):
                assert container.port(port["targetPort"]) == port["port"], f"{service}: {port}"
    for workload in workloads:
        if workload.kind == "StatefulSet":
            # The API server refuses a selector its own template does not match.
            labels = kube.pod(workload)["metadata"]["labels"].items()
            assert workload.doc["spec"]["selector"]["matchLabels"].items() <= labels, workload
            headless = services[workload.doc["spec"]["serviceName"]]
            assert headless.doc["spec"]["clusterIP"] == "None", f"{workload}: {headless}"
    for budget in (m for m in objects if m.kind == "PodDisruptionBudget"):
        labels = budget.doc["spec"]["selector"]["matchLabels"].items()
        assert any(labels <= kube.pod(w)["metadata"]["labels"].items() for w in workloads), budget


@pytest.mark.parametrize("tree", TREES)
def test_clients_reach_the_coordinator_through_its_service(tree: str) -> None:
    """The examples' --coord and rdzvHost:rdzvPort are the coordinator Service's gRPC port, with
    either variant applied."""
    services = {m.name: m for m in kube.tree(tree) if m.kind == "Service"}
    grpc = coordinator_of(tree).ports()["grpc"]
    (worker,) = running("sar-worker")
    policy = only(kube.manifests(), "PyTorchJob").doc["spec"]["elasticPolicy"]
    for target in (worker.env()["SARCOMM_COORD"], f"{policy['rdzvHost']}:{policy['rdzvPort']}"):
        host, port = host_port(target)
        assert host in services, f"{target}: no Service {host}"
        (entry,) = [p for p in services[host].doc["spec"]["ports"] if p["port"] == port]
        assert coordinator_of(tree).port(entry["targetPort"]) == grpc, f"{target}: {entry}"


def test_every_pod_turns_off_service_links() -> None:
    """Kubernetes gives every pod SARCOMM_COORDINATOR_SERVICE_HOST and the like for the Services
    here (and any Service named sarcomm-*): SARCOMM_ variables that both programs scan for flags."""
    pods = [m for m in kube.manifests() if kube.pod_template(m) is not None]
    assert [str(m) for m in pods if kube.pod(m)["spec"].get("enableServiceLinks") is not False] == []


def test_token_file_is_the_sarcomm_token_secret() -> None:
    for container in kube.containers():
        if container.program()[0] == "etcd":
            continue
        path = container.env()["SARCOMM_TOKEN_FILE"]
        volume = container.volume_at(path)
        assert volume is not None, f"{container}: {path} is on no volume"
        mount = next(m for m in container.spec["volumeMounts"] if m["name"] == volume["name"])
        assert volume["secret"]["secretName"] == "sarcomm-token", container
        assert volume["secret"]["items"] == [{"key": "token", "path": Path(path).name}], container
        assert Path(mount["mountPath"]) == Path(path).parent, container
        assert mount["readOnly"], container
    assert "create secret generic sarcomm-token" in (kube.KUBERNETES / "README.md").read_text()


# -- the jobs --------------------------------------------------------------------------------------


def script_problems(container: Container, command: list[str]) -> list[str]:
    """``python SCRIPT FLAGS`` or ``SCRIPT FLAGS``: the script is one of examples/ as the image
    has them, and every flag appears in it."""
    workdir, examples = kube.image_workdir_and_examples()
    script = next(a for a in command if a.endswith(".py"))
    in_image = str(Path(workdir, script))
    if not in_image.startswith(examples + "/"):
        return [f"{container}: {script} is not under {examples}"]
    source = kube.ROOT / "examples" / Path(in_image).relative_to(examples)
    if not source.is_file():
        return [f"{container}: {source} does not exist"]
    text = source.read_text()
    return [f"{source.name} has no {a}" for a in command if a.startswith("--") and f'"{a}"' not in text]


def test_indexed_job_runs_sar_worker_with_settings_it_accepts(tmp_path: Path) -> None:
    (container,) = running("sar-worker")
    spec = container.workload.doc["spec"]
    _, args, _ = container.program()
    env = container.env()
    assert {a for a in args[: args.index("--")] if a.startswith("--")} <= flags_of("sar-worker")
    assert {v for v in env if v.startswith("SARCOMM_")} <= variables_of("sar-worker")
    (tmp_path / "token").write_text("a-token\n")
    config, subcommand, _, _ = worker_cli.parse(args, env | {"SARCOMM_TOKEN_FILE": str(tmp_path / "token")})
    assert subcommand is None
    assert list(config.command) == args[args.index("--") + 1 :]
    assert script_problems(container, args[args.index("--") + 1 :]) == []
    assert job_name(config.job) == container.workload.name
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    assert config.world_size == spec["completions"] * config.nproc_per_node
    # sar-worker restarts the ranks; the Job replaces a lost pod as often as the agents restart.
    assert container.pod["spec"]["restartPolicy"] == "Never"
    assert spec["backoffLimit"] == config.max_restarts
    fail_job = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert [r["onExitCodes"] for r in fail_job] == [
        {"containerName": container.name, "operator": "In", "values": [EXIT_USAGE, EXIT_SPAWN_FAILED]}
    ]


def torch_handlers() -> set[str]:
    """The torchrun.handlers entry points installing sarcomm registers; before the plugin lands,
    the name issue 21 gives it."""
    points = importlib.metadata.entry_points(group="torchrun.handlers")
    return {p.name for p in points if p.dist is not None and p.dist.name == "sarcomm"} or {"sarcomm"}


def test_pytorchjob_hands_torchrun_the_sarcomm_rendezvous() -> None:
    job = only(kube.manifests(), "PyTorchJob")
    spec = job.doc["spec"]
    policy, workers = spec["elasticPolicy"], spec["pytorchReplicaSpecs"]["Worker"]
    # What the training-operator (pkg/controller.v1/pytorch/elastic.go) gives torchrun.
    pet = {
        "PET_RDZV_BACKEND": policy["rdzvBackend"],
        "PET_RDZV_ENDPOINT": f"{policy['rdzvHost']}:{policy['rdzvPort']}",
        "PET_RDZV_ID": policy["rdzvId"],
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_NPROC_PER_NODE": spec["nprocPerNode"],
        "PET_RDZV_CONF": ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"]),
    }
    assert pet["PET_RDZV_BACKEND"] in torch_handlers()
    assert job_name(pet["PET_RDZV_ID"])
    assert DNS_1035_LABEL.fullmatch(job.name)
    assert 1 <= policy["minReplicas"] <= workers["replicas"] <= policy["maxReplicas"]
    assert int(pet["PET_NPROC_PER_NODE"]) >= 1
    assert "nProcPerNode" not in policy
    for item in pet["PET_RDZV_CONF"].split(","):
        key, _, value = item.partition("=")
        assert key in RDZV_CONF_KEYS, item
        assert float(value) > 0, item
    (container,) = [c for c in kube.containers([job]) if c.name == "pytorch"]
    program, args, _ = container.program()
    # The rendezvous comes from PET_*: a flag before the script would override the operator's.
    assert program == "torchrun"
    assert not args[0].startswith("-")
    assert script_problems(container, args) == []
    security = {env_name(f) for f in CLIENT_SECURITY_FLAGS}
    assert security <= variables_of("sar-worker")
    assert {v for v in container.env() if v.startswith("SARCOMM_")} <= security

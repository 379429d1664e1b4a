"""deploy/kubernetes/ read as Kubernetes would read it, for tests/test_kubernetes.py.

- :func:`manifests` every YAML document under deploy/kubernetes/ (kustomizations apart), and
  :func:`tree` the documents one kustomization applies (its ``resources``, followed into folders).
- :class:`Container` one container of a pod template, with what Kubernetes gives it: its env with
  the downward API filled in (:data:`DOWNWARD_API` says with what), ``$(VAR)`` expanded in its
  command and args, the program it runs (after ``env -u NAME``) and its mounts.
- :func:`image_environment` the ``SARCOMM_*`` variables the image (deploy/docker/Dockerfile) sets.
- :func:`kubeflow_problems` a PyTorchJob against Kubeflow's own API models (PyPI's
  kubeflow-training), read from their source.

Only PyYAML and the standard library: no cluster, no kubectl, no kustomize.
"""

from __future__ import annotations

import ast
import importlib.metadata
import posixpath
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBERNETES = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
KUSTOMIZATION = "kustomization.yaml"

Doc = dict[str, Any]
#: libyaml's safe loader where PyYAML has it (ten times faster on the vendored CRD schema).
YAML_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

#: What the downward API gives a container in these tests: a pod's name, namespace and IP, and the
#: labels and annotations the Job controller sets (the job name is filled in per pod).
DOWNWARD_API = {
    "metadata.name": "{workload}-0",
    "metadata.namespace": "default",
    "status.podIP": "10.1.2.3",
    "metadata.labels['batch.kubernetes.io/job-name']": "{workload}",
    "metadata.annotations['batch.kubernetes.io/job-completion-index']": "0",
}
#: Where a kind keeps its pod template.
POD_TEMPLATE_PATHS = {
    "StatefulSet": ("spec", "template"),
    "Deployment": ("spec", "template"),
    "Job": ("spec", "template"),
}
_VARIABLE_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(frozen=True)
class Manifest:
    """One YAML document: ``path`` relative to deploy/kubernetes/, its position in the file."""

    path: str
    index: int
    doc: Doc

    @property
    def kind(self) -> str:
        return str(self.doc["kind"])

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])

    def __str__(self) -> str:
        return f"{self.path} ({self.kind} {self.name})"


def _load(path: Path) -> list[Doc]:
    with path.open() as file:
        return [doc for doc in yaml.load_all(file, Loader=YAML_LOADER) if doc is not None]


@cache
def documents() -> tuple[Manifest, ...]:
    """Every document of every YAML file under deploy/kubernetes/, kustomizations included."""
    found: list[Manifest] = []
    for path in sorted(KUBERNETES.rglob("*.yaml")):
        relative = path.relative_to(KUBERNETES).as_posix()
        found.extend(Manifest(relative, i, doc) for i, doc in enumerate(_load(path)))
    return tuple(found)


def manifests() -> list[Manifest]:
    """Every Kubernetes object under deploy/kubernetes/ (not the kustomizations)."""
    return [m for m in documents() if m.kind != "Kustomization"]


def kustomizations() -> list[Manifest]:
    return [m for m in documents() if m.kind == "Kustomization"]


def tree(kustomization: str) -> list[Manifest]:
    """The objects the kustomization at ``kustomization`` (a folder relative to deploy/kubernetes/,
    "" for the top) applies: its ``resources``, folders followed to their own kustomization.

    Raises:
        AssertionError: a resource that does not exist.
    """
    folder = posixpath.normpath(kustomization) if kustomization else "."
    path = f"{folder}/{KUSTOMIZATION}" if folder != "." else KUSTOMIZATION
    (own,) = [m for m in kustomizations() if m.path == path]
    found: list[Manifest] = []
    for resource in own.doc.get("resources", []):
        target = posixpath.normpath(posixpath.join(folder, resource))
        assert (KUBERNETES / target).exists(), f"{path}: resource {resource!r} does not exist"
        if (KUBERNETES / target).is_dir():
            found.extend(tree(target))
        else:
            found.extend(m for m in manifests() if m.path == target)
    return found


def pod(manifest: Manifest) -> Doc:
    """The pod template of a workload (:func:`pod_template`, which must find one)."""
    template = pod_template(manifest)
    assert template is not None, f"{manifest} has no pod template"
    return template


def pod_template(manifest: Manifest) -> Doc | None:
    """The pod template of a workload (a PyTorchJob's Worker template too), else None."""
    if manifest.kind == "PyTorchJob":
        template: Doc = manifest.doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        return template
    keys = POD_TEMPLATE_PATHS.get(manifest.kind)
    if keys is None:
        return None
    node: Doc = manifest.doc
    for key in keys:
        node = node[key]
    return node


@dataclass(frozen=True)
class Container:
    """One container of ``workload``'s pod template, as Kubernetes starts it."""

    workload: Manifest
    pod: Doc
    spec: Doc

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def __str__(self) -> str:
        return f"{self.workload}, container {self.name}"

    def env(self) -> dict[str, str]:
        """The container's variables from its manifest: values, and the downward API's fields
        filled in from :data:`DOWNWARD_API` (``$(VAR)`` in a value expanded from earlier ones).

        Raises:
            AssertionError: a ``valueFrom`` this test does not know how to fill in.
        """
        values: dict[str, str] = {}
        for item in self.spec.get("env", []):
            if "value" in item:
                values[item["name"]] = expand(str(item["value"]), values)
                continue
            field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            assert field in DOWNWARD_API, f"{self}: {item['name']} comes from {item.get('valueFrom')}"
            values[item["name"]] = DOWNWARD_API[field].format(workload=self.workload.name)
        return values

    def argv(self) -> list[str]:
        """command + args with ``$(VAR)`` expanded from :meth:`env`."""
        env = self.env()
        return [expand(arg, env) for arg in [*self.spec.get("command", []), *self.spec.get("args", [])]]

    def program(self) -> tuple[str, list[str], set[str]]:
        """(the program's name, its arguments, the variables ``env -u`` removes before it)."""
        argv = self.argv()
        assert argv, f"{self}: name the program in `command` (the image's default is sar-coordinator)"
        unset: set[str] = set()
        if posixpath.basename(argv[0]) == "env":
            rest = argv[1:]
            while rest and (rest[0] == "-u" or "=" in rest[0]):
                if rest[0] == "-u":
                    unset.add(rest[1])
                    rest = rest[2:]
                else:
                    rest = rest[1:]
            argv = rest
        return posixpath.basename(argv[0]), argv[1:], unset

    def ports(self) -> dict[str, int]:
        """Container port numbers by name."""
        return {p["name"]: int(p["containerPort"]) for p in self.spec.get("ports", []) if "name" in p}

    def port(self, port: int | str) -> int:
        """A probe's or a Service's port (a number, or the name of one of this container's)."""
        if isinstance(port, int):
            return port
        assert port in self.ports(), f"{self}: no container port named {port!r}"
        return self.ports()[port]

    def volume_at(self, path: str) -> Doc | None:
        """The pod volume mounted over ``path`` (the longest mount path that holds it), None when
        ``path`` is on the container's own file system."""
        mounts = [
            m
            for m in self.spec.get("volumeMounts", [])
            if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
        ]
        if not mounts:
            return None
        mount = max(mounts, key=lambda m: len(m["mountPath"]))
        claims = self.workload.doc["spec"].get("volumeClaimTemplates", [])
        for claim in claims:
            if claim["metadata"]["name"] == mount["name"]:
                return {"name": mount["name"], "persistentVolumeClaimTemplate": claim}
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes", [])}
        assert mount["name"] in volumes, f"{self}: the volume {mount['name']!r} is not in the pod"
        volume: Doc = volumes[mount["name"]]
        return volume


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable's value, anything else left as is."""
    return _VARIABLE_REFERENCE.sub(
        lambda m: env.get(m.group(1), m.group(0)), text.replace("$$", "\0")
    ).replace("\0", "$")


def containers(objects: list[Manifest] | None = None) -> Iterator[Container]:
    """Every container (init containers too) of every pod template among ``objects`` (default:
    every manifest)."""
    for manifest in manifests() if objects is None else objects:
        pod = pod_template(manifest)
        if pod is None:
            continue
        for spec in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]:
            yield Container(manifest, pod, spec)


def image_environment() -> dict[str, str]:
    """The ``SARCOMM_*`` variables the image's last stage sets (its ``ENV`` lines)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    last_stage = text.split("\nFROM ")[-1]
    env: dict[str, str] = {}
    for line in last_stage.splitlines():
        if line.startswith("ENV "):
            for item in line[len("ENV ") :].split():
                name, _, value = item.partition("=")
                if name.startswith("SARCOMM_"):
                    env[name] = value
    return env


def image_workdir_and_examples() -> tuple[str, str]:
    """(the image's WORKDIR, where it copies examples/ to)."""
    text = DOCKERFILE.read_text()
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", text, re.M)
    (examples,) = re.findall(r"^COPY examples/ (\S+)$", text, re.M)
    return workdir, examples.rstrip("/")


#: The v1 PyTorchJob's API models: Kubeflow's Python SDK for the training-operator, generated (like
#: the operator's CRDs) from its Go types in pkg/apis/kubeflow.org/v1.
KUBEFLOW_SDK = "kubeflow-training"
_LIST = re.compile(r"list\[(.+)\]")
_MAP = re.compile(r"dict\(str, (.+)\)")
_SCALARS: dict[str, Callable[[object], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "object": lambda v: True,
}


@cache
def kubeflow_models() -> dict[str, dict[str, str]]:
    """Each model class of :data:`KUBEFLOW_SDK`: {JSON field: its type}, read from the classes'
    ``openapi_types`` and ``attribute_map`` in the installed source (nothing of it is imported:
    it would import the whole Kubernetes client)."""
    models: dict[str, dict[str, str]] = {}
    for file in importlib.metadata.files(KUBEFLOW_SDK) or []:
        if "/models/" not in file.as_posix() or file.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(Path(str(file.locate())).read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            tables = {
                target.id: ast.literal_eval(statement.value)
                for statement in node.body
                if isinstance(statement, ast.Assign)
                for target in statement.targets
                if isinstance(target, ast.Name) and target.id in ("openapi_types", "attribute_map")
            }
            if len(tables) == 2:
                names, types = tables["attribute_map"], tables["openapi_types"]
                models[node.name] = {names[attribute]: types[attribute] for attribute in types}
    return models


def kubeflow_problems(
    value: object, model: str, where: str, outside: dict[str, Callable[[Any], list[str]]]
) -> list[str]:
    """What is wrong with ``value`` as Kubeflow's ``model`` (a model class or a type such as
    ``list[X]``): unknown fields and wrong types, each named by its path. Types from outside the
    SDK (Kubernetes' own, e.g. ``V1PodTemplateSpec``) go to ``outside[type]``; one it lacks is a
    problem."""
    models = kubeflow_models()
    if model in _SCALARS:
        return [] if _SCALARS[model](value) else [f"{where}: {value!r} is not of type {model}"]
    match = _LIST.fullmatch(model) or _MAP.fullmatch(model)
    if match is not None:
        if not isinstance(value, list if match.re is _LIST else dict):
            return [f"{where}: {value!r} is not a {model}"]
        items = enumerate(value) if isinstance(value, list) else value.items()
        return [
            problem
            for key, item in items
            for problem in kubeflow_problems(item, match[1], f"{where}.{key}", outside)
        ]
    if model not in models:
        if model not in outside:
            return [f"{where}: {model} is checked nowhere"]
        return outside[model](value)
    if not isinstance(value, dict):
        return [f"{where}: {value!r} is not an object ({model})"]
    fields = models[model]
    problems = [
        f"{where}: unknown field {key!r} ({model} has {sorted(fields)})" for key in value if key not in fields
    ]
    for key, item in value.items():
        if key in fields:
            problems += kubeflow_problems(item, fields[key], f"{where}.{key}", outside)
    return problems

"""Helm chart: rendered with the real Helm SDK, linted, validated against Kubernetes 1.30 schemas."""

import copy
import json
import pathlib

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from moemesh.operator import manifests
from moemesh.operator.spec import parse_spec

CHART = pathlib.Path(__file__).resolve().parents[2] / "charts" / "moemesh"
VALUES_FILES = {
    "defaults": None,
    "gpu-cluster": CHART / "ci" / "gpu-cluster-values.yaml",
    "external-redis": CHART / "ci" / "external-redis-values.yaml",
    "no-default-mesh": CHART / "ci" / "no-default-mesh-values.yaml",
}
NOT_IN_KUBERNETES_SCHEMAS = {"InferenceMesh", "ServiceMonitor"}  # custom resources


@pytest.fixture(scope="module")
def chart():
    return helm.Chart.load(str(CHART))


@pytest.fixture(scope="module")
def crd():
    return yaml.safe_load((CHART / "crds" / "inferencemeshes.moemesh.io.yaml").read_text())


def load_values(case):
    path = VALUES_FILES[case]
    return yaml.safe_load(path.read_text()) if path else None


def render(chart, values, namespace="moemesh"):
    rendered = chart.render(values, name="mm", namespace=namespace)
    docs = []
    for path, text in rendered.items():
        if path.endswith(".txt"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def by_kind(docs, kind):
    return [doc for doc in docs if doc["kind"] == kind]


def mesh_schema(crd):
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def validate_cr(crd, body):
    # The CRD schema is OpenAPI 3.0 (draft-4 style exclusiveMaximum); x-kubernetes-* are ignored.
    jsonschema.Draft4Validator(mesh_schema(crd)).validate(body)


@pytest.mark.parametrize("case", VALUES_FILES)
def test_every_rendered_manifest_validates_against_kubernetes_1_30(chart, crd, case):
    docs = render(chart, load_values(case))
    assert docs
    for doc in docs:
        if doc["kind"] == "InferenceMesh":
            validate_cr(crd, doc)
        elif doc["kind"] not in NOT_IN_KUBERNETES_SCHEMAS:
            kubernetes_validate.validate(doc, "1.30", strict=True)


@pytest.mark.parametrize("case", VALUES_FILES)
def test_lint_is_clean(case):
    report = helm.lint(str(CHART), load_values(case), strict=True, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert (report["errors"], problems) == ([], [])


def test_crd_is_a_valid_v1_custom_resource_definition(crd):
    kubernetes_validate.validate(crd, "1.30", strict=True)
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.decode.replicas"
    assert {c["name"] for c in version["additionalPrinterColumns"]} >= {"Model", "Decode", "Placement", "Ready"}


def test_defaults_install_operator_redis_and_a_mesh(chart):
    docs = render(chart, None)
    kinds = sorted(doc["kind"] for doc in docs)
    assert kinds == sorted([
        "ClusterRole", "ClusterRoleBinding", "Deployment", "InferenceMesh", "NetworkPolicy", "NetworkPolicy",
        "NetworkPolicy", "Pod", "PodDisruptionBudget", "Secret", "Service", "ServiceAccount", "StatefulSet",
    ])
    [operator] = by_kind(docs, "Deployment")
    assert operator["spec"]["replicas"] == 1 and operator["spec"]["strategy"] == {"type": "Recreate"}
    container = operator["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "moemesh/moemesh-operator:0.1.0"
    assert container["command"][:4] == ["kopf", "run", "-m", "moemesh.operator.main"]
    env = {e["name"]: e for e in container["env"]}
    assert env["MOEMESH_REDIS_URL"]["value"] == "redis://mm-moemesh-redis.moemesh.svc:6379/0"
    assert env["MOEMESH_DEFAULT_IMAGE"]["value"] == "moemesh/moemesh-services:0.1.0"
    assert env["MOEMESH_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "mm-moemesh-redis", "key": "redis-password"}
    [test_pod] = by_kind(docs, "Pod")
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert "http://default-router.moemesh.svc:8000/v1/models" in test_pod["spec"]["containers"][0]["command"][2]


def test_every_pod_runs_as_non_root_without_privilege_escalation(chart):
    for case in VALUES_FILES:
        for doc in render(chart, load_values(case)):
            pod = doc["spec"] if doc["kind"] == "Pod" else doc.get("spec", {}).get("template", {}).get("spec")
            if pod is None:
                continue
            assert pod["securityContext"]["runAsNonRoot"] is True, doc["metadata"]["name"]
            for container in pod["containers"]:
                assert container["securityContext"]["allowPrivilegeEscalation"] is False
                assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_rbac_is_least_privilege(chart):
    [role] = by_kind(render(chart, None), "ClusterRole")
    rules = {(group, resource): set(rule["verbs"]) for rule in role["rules"]
             for group in rule["apiGroups"] for resource in rule["resources"]}
    assert all("*" not in verbs for verbs in rules.values())
    assert rules[("", "secrets")] == {"get"}
    assert rules[("apps", "deployments")] == {"get", "create", "patch", "delete"}
    assert rules[("moemesh.io", "inferencemeshes/status")] == {"get", "patch", "update"}


def test_gpu_cluster_puts_gpus_in_limits_and_enables_the_service_monitor(chart, crd):
    docs = render(chart, load_values("gpu-cluster"))
    [mesh] = by_kind(docs, "InferenceMesh")
    for role in ("prefill", "decode", "expert"):
        assert mesh["spec"][role]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "nvidia.com/gpu" not in mesh["spec"][role]["resources"]["requests"]
    assert mesh["spec"]["eplb"]["redundantSlots"] == 8
    [monitor] = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    [redis] = by_kind(docs, "StatefulSet")
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "4Gi"


def test_external_redis_renders_no_redis_and_points_the_mesh_at_it(chart):
    docs = render(chart, load_values("external-redis"))
    assert by_kind(docs, "StatefulSet") == [] and by_kind(docs, "Secret") == []
    [mesh] = by_kind(docs, "InferenceMesh")
    assert mesh["spec"]["redis"] == {"url": "redis://redis.shared.svc:6379/0",
                                     "passwordSecretRef": {"name": "shared-redis", "key": "password"}}
    [operator] = by_kind(docs, "Deployment")
    env = {e["name"]: e for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MOEMESH_REDIS_URL"]["value"] == "redis://redis.shared.svc:6379/0"


def test_an_otlp_endpoint_reaches_every_service_through_the_mesh_config(chart):
    values = {"mesh": {"telemetry": {"otlpEndpoint": "otel-collector.monitoring.svc:4317"}}}
    [mesh] = by_kind(render(chart, values), "InferenceMesh")
    assert mesh["spec"]["telemetry"] == {"otlpEndpoint": "otel-collector.monitoring.svc:4317"}
    spec = parse_spec(mesh["spec"], default_image="unused")
    config = manifests.config_map(spec, "m", "ns", "uid", "redis://r:6379/0")
    assert json.loads(config["data"]["mesh.json"])["otlp_endpoint"] == "otel-collector.monitoring.svc:4317"
    [default] = by_kind(render(chart, {}), "InferenceMesh")  # empty by default: no telemetry section
    assert "telemetry" not in default["spec"]
    assert "otlp_endpoint" not in json.loads(manifests.config_map(
        parse_spec(default["spec"], default_image="unused"), "m", "ns", "uid", "redis://r")["data"]["mesh.json"])
    from moemesh.operator.spec import SpecError

    with pytest.raises(SpecError, match="spec.telemetry.otlpEndpoint must be"):
        parse_spec({**SAMPLE["spec"], "telemetry": {"otlpEndpoint": "two words"}}, default_image="unused")


def test_no_default_mesh_renders_no_mesh_and_no_test_pod(chart):
    docs = render(chart, load_values("no-default-mesh"))
    assert by_kind(docs, "InferenceMesh") == [] and by_kind(docs, "Pod") == []
    assert by_kind(docs, "NetworkPolicy") == []


@pytest.mark.parametrize("case", ["defaults", "gpu-cluster", "external-redis"])
def test_the_operator_accepts_the_chart_mesh_and_its_children_validate(chart, case):
    [mesh] = by_kind(render(chart, load_values(case)), "InferenceMesh")
    spec = parse_spec(mesh["spec"], default_image="unused")
    replicas = {role: spec.roles[role].replicas for role in ("router", "prefill", "decode", "expert")}
    for child in manifests.children(spec, mesh["metadata"]["name"], "moemesh", "uid-1", replicas,
                                    "redis://r:6379/0", ("s", "k")):
        kubernetes_validate.validate(child, "1.30", strict=True)


SAMPLE = {
    "apiVersion": "moemesh.io/v1alpha1",
    "kind": "InferenceMesh",
    "metadata": {"name": "m"},
    "spec": {
        "model": {"name": "m", "source": "/models/m", "numMoeLayers": 2, "numExperts": 8},
        "decode": {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "8Gi"}}},
        "autoscaling": {"enabled": True, "prefillDecodeRatio": {"min": 0.5, "max": 2}},
        "eplb": {"redundantSlots": 2, "imbalanceThreshold": 0.1},
        "redis": {"url": "redis://r:6379/0", "passwordSecretRef": {"name": "s"}},
        "telemetry": {"otlpEndpoint": "otel-collector.monitoring.svc:4317"},
    },
}


def test_crd_schema_accepts_a_full_sample(crd):
    validate_cr(crd, SAMPLE)


@pytest.mark.parametrize(
    "path, value",
    [
        (("spec", "decode", "replicas"), -1),
        (("spec", "image"), {"repository": "r", "pullPolicy": "Sometimes"}),
        (("spec", "eplb", "imbalanceThreshold"), 1.0),
        (("spec", "redis", "url"), "http://r:6379"),
        (("spec", "model", "name"), ""),
        (("spec", "autoscaling", "maxStepUp"), 0),
        (("spec", "telemetry", "otlpEndpoint"), "two words"),
    ],
)
def test_crd_schema_rejects_invalid_samples(crd, path, value):
    body = copy.deepcopy(SAMPLE)
    target = body
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate_cr(crd, body)


def test_crd_schema_requires_a_model(crd):
    with pytest.raises(jsonschema.ValidationError, match="'model' is a required property"):
        validate_cr(crd, {**SAMPLE, "spec": {"decode": {"replicas": 1}}})


@pytest.mark.parametrize(
    "values",
    [
        {"redis": {"managed": False}},
        {"redis": {"managed": True, "externalUrl": "http://x"}},
        {"mesh": {"enabled": True, "name": "Bad_Name"}},
        {"mesh": {"enabled": True, "decode": {"replicas": -1}}},
        {"mesh": {"enabled": True, "eplb": {"imbalanceThreshold": 2}}},
        {"image": {"services": {"repository": "x", "pullPolicy": "Sometimes"}}},
        {"unknownKey": 1},
    ],
)
def test_values_schema_rejects_invalid_values(chart, values):
    with pytest.raises(helm.HelmError):
        chart.validate_schema(chart.merge_values(values))


@pytest.mark.parametrize("case", VALUES_FILES)
def test_values_schema_accepts_the_shipped_values_files(chart, case):
    chart.validate_schema(chart.merge_values(load_values(case)))

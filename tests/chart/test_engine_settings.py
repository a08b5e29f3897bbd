"""The engine settings of an InferenceMesh: the CRD's and values.schema.json's schemas are the ones
generated from the config definition; chart values `mesh.engine` / `mesh.<role>.engine` reach the
CR, the operator's mesh.json and every role's resolved settings; bad values are refused by the
schema and by parse_spec with the field's path."""

from __future__ import annotations

import json
import pathlib

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from moemesh.cli import build_parser
from moemesh.operator import engine_schema, manifests
from moemesh.operator.spec import SpecError, parse_spec
from moemesh.router.settings import router_settings
from moemesh.runtime.engine_config import BY_NAME, options_of
from moemesh.worker.settings import worker_settings

CHART = pathlib.Path(__file__).resolve().parents[2] / "charts" / "moemesh"
CRD_PATH = CHART / "crds" / "inferencemeshes.moemesh.io.yaml"
VALUES_SCHEMA_PATH = CHART / "values.schema.json"
ROLES = ("router", "prefill", "decode", "expert")
MODEL = {"name": "m", "source": {"builtin": "smollm2"}}


@pytest.fixture(scope="module")
def chart():
    return helm.Chart.load(str(CHART))


@pytest.fixture(scope="module")
def crd():
    return yaml.safe_load(CRD_PATH.read_text())


def spec_schema(crd) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def validate_cr(crd, spec: dict) -> None:
    body = {"apiVersion": "moemesh.io/v1alpha1", "kind": "InferenceMesh", "metadata": {"name": "m"}, "spec": spec}
    jsonschema.Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(body)


def the_mesh(chart, values: dict) -> dict:
    rendered = chart.render(values, name="mm", namespace="ns")
    docs = [doc for path, text in rendered.items() if not path.endswith(".txt") for doc in yaml.safe_load_all(text)]
    [mesh] = [doc for doc in docs if doc and doc["kind"] == "InferenceMesh"]
    return mesh


def settings_of(spec, role: str, tmp_path):
    """The role's settings as its pod resolves them: the manifests' command and mesh.json."""
    config = tmp_path / "mesh.json"
    config.write_text(manifests.config_map(spec, "m", "ns", "uid", "redis://r")["data"]["mesh.json"])
    workload = manifests.workload(spec, "m", "ns", "uid", role, 1, None)
    kubernetes_validate.validate(workload, "1.30", strict=True)
    command = workload["spec"]["template"]["spec"]["containers"][0]["command"]
    args = build_parser().parse_args([a.replace(manifests.CONFIG_PATH, str(config)) for a in command[1:]])
    build = router_settings if role == "router" else worker_settings
    return build(args, env={"POD_NAME": f"m-{role}-0", "POD_IP": "10.0.0.9"})


# -- generated schemas -----------------------------------------------------------------------------


def test_the_committed_crd_and_values_schema_are_what_the_definition_generates(crd):
    assert engine_schema.rewrite_crd(CRD_PATH.read_text()) == CRD_PATH.read_text()
    assert engine_schema.rewrite_values_schema(VALUES_SCHEMA_PATH.read_text()) == VALUES_SCHEMA_PATH.read_text()
    spec = spec_schema(crd)["properties"]
    assert spec["engine"] == engine_schema.engine_schema(engine_schema.OPENAPI)
    for role in ROLES:
        assert spec[role]["properties"]["engine"] == engine_schema.engine_schema(engine_schema.OPENAPI, per_role=True)
    values = json.loads(VALUES_SCHEMA_PATH.read_text())
    assert values["definitions"]["engine"] == engine_schema.engine_schema(engine_schema.DRAFT7)
    assert values["definitions"]["roleEngine"] == engine_schema.engine_schema(engine_schema.DRAFT7, per_role=True)
    assert values["properties"]["mesh"]["properties"]["engine"] == {"$ref": "#/definitions/engine"}
    assert values["definitions"]["role"]["properties"]["engine"] == {"$ref": "#/definitions/roleEngine"}
    assert engine_schema.main([str(CHART), "--check"]) == 0


def test_the_crd_schema_has_every_engine_option_but_the_model_which_spec_model_source_names(crd):
    engine = spec_schema(crd)["properties"]["engine"]["properties"]
    assert {BY_NAME[name].camel for name in BY_NAME} - set(engine) == {"model"}
    role = spec_schema(crd)["properties"]["decode"]["properties"]["engine"]["properties"]
    assert set(engine) - set(role) == {"dtype", "maxModelLen", "blockSize", "cacheSalt"}  # one value per mesh


# -- values -> CR -> mesh.json -> every role -------------------------------------------------------

ENGINE = {
    "dtype": "float32",
    "maxModelLen": 4096,
    "blockSize": 32,
    "cacheSalt": "tenant-a",
    "quantization": "none",
    "enablePrefixCaching": False,
    "enableChunkedPrefill": False,
    "microBatchOverlap": "off",
    "kvMemoryGib": 2.5,
    "speculativeMethod": "ngram",
    "numSpeculativeTokens": 3,
    "speculativeScheduling": "fixed",
    "ngramMaxN": 5,
}
DECODE_ENGINE = {"maxNumSeqs": 16, "maxNumBatchedTokens": 512, "kvMemoryGib": 6}


def test_chart_engine_values_reach_every_roles_settings_through_the_cr_and_mesh_json(chart, crd, tmp_path):
    values = {"mesh": {"engine": ENGINE, "decode": {"engine": DECODE_ENGINE}, "expert": {"engine": {"device": "cpu"}}}}
    chart.validate_schema(chart.merge_values(values))
    mesh = the_mesh(chart, values)
    assert (mesh["spec"]["engine"], mesh["spec"]["decode"]["engine"]) == (ENGINE, DECODE_ENGINE)
    validate_cr(crd, mesh["spec"])
    spec = parse_spec(mesh["spec"], default_image="unused")
    config = json.loads(manifests.config_map(spec, "m", "ns", "uid", "redis://r")["data"]["mesh.json"])
    assert config["engine"]["kv_memory_gib"] == 2.5 and config["engine"]["micro_batch_overlap"] == "off"
    assert config["roles"] == {
        "decode": {"engine": {"kv_memory_gib": 6, "max_num_seqs": 16, "max_num_batched_tokens": 512}},
        "expert": {"engine": {"device": "cpu"}},
    }
    decode = options_of(settings_of(spec, "decode", tmp_path).engine.config)
    expected = {name: BY_NAME[name].parse(v) for name, v in config["engine"].items()}
    assert {name: decode[name] for name in expected} == {**expected, "kv_memory_gib": 6}
    assert (decode["max_num_seqs"], decode["max_num_batched_tokens"]) == (16, 512)
    prefill = settings_of(spec, "prefill", tmp_path).engine.config
    assert (prefill.cache.memory_gib, prefill.scheduler.max_num_seqs, prefill.spec.method) == (2.5, 64, "none")
    assert (prefill.cache.block_size, prefill.cache.cache_salt, prefill.model.quantization) == (32, "tenant-a", "none")
    expert = settings_of(spec, "expert", tmp_path).engine
    assert (expert.dtype, expert.device) == ("float32", "cpu")
    router = settings_of(spec, "router", tmp_path)
    assert (router.block_size, router.max_model_len) == (32, 4096)  # its prefix hashes match the workers'


def test_the_default_chart_sets_no_engine_and_the_pods_resolve_the_defaults(chart, tmp_path):
    mesh = the_mesh(chart, {})
    assert "engine" not in mesh["spec"] and "dtype" not in mesh["spec"]["model"]
    spec = parse_spec(mesh["spec"], default_image="unused")
    config = json.loads(manifests.config_map(spec, "m", "ns", "uid", "redis://r")["data"]["mesh.json"])
    assert "engine" not in config and "roles" not in config
    assert manifests.workload(spec, "m", "ns", "uid", "router", 1, None)["spec"]["template"]["spec"]["containers"][0][
        "command"
    ][-2:] == ["--host", "$(POD_IP)"]
    decode = settings_of(spec, "decode", tmp_path).engine.config
    assert (decode.cache.memory_gib, decode.cache.block_size, decode.model.dtype) == (1.0, 16, "auto")


def test_spec_engine_dtype_wins_over_the_deprecated_spec_model_dtype():
    def dtype(spec):
        return parse_spec({"model": MODEL, **spec}, default_image="unused").engine.mesh.get("dtype")

    assert dtype({"model": {**MODEL, "dtype": "bfloat16"}}) == "bfloat16"
    assert dtype({"model": {**MODEL, "dtype": "bfloat16"}, "engine": {"dtype": "float32"}}) == "float32"
    assert dtype({}) is None


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"engine": {"blockSzie": 16}}, "spec.engine.blockSzie: not an engine setting"),
        ({"engine": {"model": "/m"}}, "spec.engine.model: not an engine setting"),
        ({"engine": "fast"}, "spec.engine must be an object, got str"),
        ({"engine": {"blockSize": 12}}, "spec.engine.blockSize must be a power of two, got 12"),
        ({"engine": {"kvMemoryGib": "8Gi"}}, "spec.engine.kvMemoryGib must be a finite number, got '8Gi'"),
        (
            {"engine": {"microBatchOverlap": True}},
            "spec.engine.microBatchOverlap must be one of auto, on, off; got True",
        ),
        (
            {"decode": {"engine": {"blockSize": 32}}},
            "spec.decode.engine.blockSize: one value for the whole mesh; set it in spec.engine.blockSize",
        ),
        (
            {"prefill": {"engine": {"speculativeMethod": "ngram"}}},
            r"spec.prefill.engine.speculativeMethod: prefill pods do not read it \(read by: decode\)",
        ),
        ({"router": {"engine": {"maxNumSeqs": 4}}}, "spec.router.engine.maxNumSeqs: router pods do not read it"),
        (
            {"engine": {"speculativeMethod": "draft"}},
            "spec.engine.speculativeMethod draft needs spec.engine.draftModel",
        ),
        (
            {"engine": {"maxNumSeqs": 128}, "decode": {"engine": {"maxNumBatchedTokens": 64}}},
            r"spec.decode.engine.maxNumBatchedTokens \(64\) must be >= spec.engine.maxNumSeqs \(128\)",
        ),
        ({"engine": {"ngramMinN": 5}}, "need spec.engine.ngramMinN <= spec.engine.ngramMaxN, got 5 > 4"),
    ],
)
def test_parse_spec_refuses_bad_engine_settings_naming_the_field(spec, message):
    with pytest.raises(SpecError, match=message):
        parse_spec({"model": MODEL, **spec}, default_image="unused")


@pytest.mark.parametrize(
    "spec",
    [
        {"engine": {"blockSize": 0}},
        {"engine": {"kvMemoryGib": 0}},
        {"engine": {"numSpeculativeTokens": 17}},
        {"engine": {"microBatchOverlap": "maybe"}},
        {"engine": {"enablePrefixCaching": "yes"}},
        {"decode": {"engine": {"device": "tpu"}}},
    ],
)
def test_the_crd_schema_refuses_engine_values_out_of_their_bounds(crd, spec):
    validate_cr(crd, {"model": MODEL})
    with pytest.raises(jsonschema.ValidationError):
        validate_cr(crd, {"model": MODEL, **spec})


@pytest.mark.parametrize(
    "values",
    [
        {"mesh": {"engine": {"blockSzie": 16}}},
        {"mesh": {"engine": {"kvMemoryGib": 0}}},
        {"mesh": {"decode": {"engine": {"blockSize": 32}}}},  # one value for the whole mesh
    ],
)
def test_the_values_schema_refuses_unknown_or_out_of_bounds_engine_values(chart, values):
    with pytest.raises(helm.HelmError):
        chart.validate_schema(chart.merge_values(values))

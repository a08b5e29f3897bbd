"""The expert role's contract with the operator's manifests (command, mesh.json, POD_NAME), and
bad input at the CLI boundary."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moemesh.cli import build_parser
from moemesh.operator import manifests
from moemesh.operator.spec import parse_spec
from moemesh.runtime.settings import SettingsError
from moemesh.worker.settings import worker_settings

SPEC = {
    "model": {"name": "m", "source": {"builtin": "smollm2"}, "numMoeLayers": 3, "numExperts": 16},
    "expert": {"replicas": 2},
}


def settings_from_manifests(role: str, tmp_path, pod_name: str, **extra):
    spec = parse_spec({**SPEC, **extra}, "img")
    config = tmp_path / "mesh.json"
    config.write_text(manifests.config_map(spec, "m", "ns", "uid", "redis://redis:6379/0")["data"]["mesh.json"])
    command = manifests.workload(spec, "m", "ns", "uid", role, 1, None)["spec"]["template"]["spec"]["containers"][0]
    argv = [a.replace(manifests.CONFIG_PATH, str(config)) for a in command["command"][1:]]
    return worker_settings(build_parser().parse_args(argv), env={"POD_NAME": pod_name, "POD_IP": "10.0.0.7"})


def test_an_expert_pod_is_an_expert_worker_named_after_its_pod(tmp_path):
    settings = settings_from_manifests("expert", tmp_path, "m-expert-1")
    assert (settings.role, settings.worker_id, settings.endpoint) == ("expert", "m-expert-1", "10.0.0.7:50051")
    assert settings.data_port == manifests.DATA_PORT  # the socket transport's port, open in the pod spec
    workload = manifests.workload(parse_spec(SPEC, "img"), "m", "ns", "uid", "expert", 1, None)
    ports = workload["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "data", "containerPort": manifests.DATA_PORT, "protocol": "TCP"} in ports
    assert settings.mesh.mesh == "ns/m" and settings.expert.remote is False
    assert manifests.expert_worker_ids("m", 2) == ["m-expert-0", "m-expert-1"]


def test_decode_pods_of_a_mesh_with_expert_workers_run_their_experts_remotely(tmp_path):
    assert settings_from_manifests("decode", tmp_path, "m-decode-abc").expert.remote is True


@pytest.mark.parametrize("transport", ["grpc", "grpc-stream", "torch-dist", "socket"])
def test_prefill_and_decode_pods_use_the_mesh_expert_transport(tmp_path, transport):
    for role in ("prefill", "decode"):
        settings = settings_from_manifests(role, tmp_path, f"m-{role}-abc", expertTransport=transport)
        assert settings.expert.transport == transport and settings.advertise_host == "10.0.0.7"
    assert settings_from_manifests("decode", tmp_path, "m-decode-abc").expert.transport == "grpc-stream"


def test_the_worker_settings_name_the_transports_and_backends_the_expert_package_has():
    from moemesh.expert.protocol.dist_group import BACKENDS
    from moemesh.expert.transports.base import TRANSPORTS
    from moemesh.worker.settings import EXPERT_DIST_BACKENDS, EXPERT_TRANSPORTS

    assert (EXPERT_TRANSPORTS, EXPERT_DIST_BACKENDS) == (tuple(TRANSPORTS), tuple(BACKENDS))


def test_expert_settings_reject_non_positive_timeouts():
    args = build_parser().parse_args(["serve", "--role", "decode", "--expert-timeout", "0"])
    with pytest.raises(SettingsError, match="call_timeout_s must be > 0"):
        worker_settings(args, env={})


def test_the_socket_busy_poll_is_a_flag_and_a_negative_one_is_refused():
    parse = build_parser().parse_args
    assert (
        worker_settings(parse(["serve", "--role", "expert", "--expert-busy-poll", "0.2"]), env={}).expert.busy_poll_s
        == 0.2
    )
    assert worker_settings(parse(["serve", "--role", "decode"]), env={}).expert.busy_poll_s > 0  # on by default
    with pytest.raises(SettingsError, match="busy_poll_s must be >= 0"):
        worker_settings(parse(["serve", "--role", "decode", "--expert-busy-poll", "-1"]), env={})


def test_an_expert_worker_on_a_dense_model_exits_2_with_the_reason(smollm_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "moemesh.cli",
            "serve",
            "--role",
            "expert",
            "--model",
            smollm_path,
            "--worker-id",
            "e0",
            "--grpc-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "LlamaForCausalLM has no MoE layers: expert workers need a Mixture-of-Experts model" in result.stderr


def test_placement_apply_of_a_missing_file_exits_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "moemesh.cli", "placement", "apply", str(tmp_path / "none.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "cannot use placement" in result.stderr


def test_confidence_scheduled_speculation_with_remote_experts_is_rejected_naming_the_fix():
    argv = ["serve", "--role", "decode", "--remote-experts", "--speculative-method", "ngram"]
    with pytest.raises(SettingsError, match="use --speculative-scheduling fixed"):
        worker_settings(build_parser().parse_args(argv), env={})
    fixed = worker_settings(build_parser().parse_args(argv + ["--speculative-scheduling", "fixed"]), env={})
    assert fixed.expert.remote and fixed.engine.config.spec.scheduling == "fixed"


def test_the_nccl_backend_on_a_cpu_worker_is_rejected_at_start_naming_the_fix():
    argv = [
        "serve",
        "--role",
        "decode",
        "--remote-experts",
        "--expert-transport",
        "torch-dist",
        "--expert-dist-backend",
        "nccl",
    ]
    with pytest.raises(SettingsError, match=r"needs --device cuda \(use gloo on the CPU\)"):
        worker_settings(build_parser().parse_args(argv), env={})
    on_gpu = worker_settings(build_parser().parse_args(argv + ["--device", "cuda"]), env={})
    assert on_gpu.expert.dist_backend == "nccl"

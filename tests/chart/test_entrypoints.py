"""Every command the Dockerfiles, the chart and the operator's manifests name must exist."""

import importlib
import importlib.util
import json
import pathlib
import re
import shutil
import sys

import helm_python as helm
import pytest
import yaml

from moemesh.operator import manifests
from moemesh.operator.spec import parse_spec

ROOT = pathlib.Path(__file__).resolve().parents[2]


def dockerfile_exec_form(name, instruction):
    text = (ROOT / "docker" / name).read_text()
    match = re.search(rf"^{instruction}\s+(\[.*\])\s*$", text, re.MULTILINE)
    assert match, f"{name} has no exec-form {instruction}"
    return json.loads(match.group(1))


def module_of_kopf_command(argv):
    assert argv[:2] == ["kopf", "run"] and "-m" in argv
    return argv[argv.index("-m") + 1]


def test_operator_image_runs_an_existing_kopf_module():
    argv = dockerfile_exec_form("Dockerfile.operator", "ENTRYPOINT")
    module = module_of_kopf_command(argv)
    assert module == "moemesh.operator.main"
    assert importlib.util.find_spec(module) is not None
    # the console script is installed beside the interpreter (a venv's bin/ need not be on PATH)
    assert (pathlib.Path(sys.executable).parent / "kopf").exists() or shutil.which("kopf") is not None


def test_chart_operator_command_matches_the_image():
    rendered = helm.Chart.load(str(ROOT / "charts" / "moemesh")).render(None, name="mm", namespace="ns")
    deployment = yaml.safe_load(rendered["moemesh/templates/operator-deployment.yaml"])
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command == dockerfile_exec_form("Dockerfile.operator", "ENTRYPOINT")


def test_dockerfiles_copy_only_existing_folders():
    for name in ("Dockerfile.services", "Dockerfile.operator"):
        for source in re.findall(r"^COPY\s+(\S+)", (ROOT / "docker" / name).read_text(), re.MULTILINE):
            assert (ROOT / source).exists(), f"{name} copies missing {source}"


def test_worker_command_is_the_services_image_entrypoint_and_serve_exists():
    entrypoint = dockerfile_exec_form("Dockerfile.services", "ENTRYPOINT")
    spec = parse_spec({"model": {"name": "m", "source": {"builtin": "smollm2"}}}, "img")
    workload = manifests.workload(spec, "m", "ns", "uid", "decode", 1, None)
    command = workload["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[: len(entrypoint)] == entrypoint == ["moemesh"]
    scripts = (ROOT / "pyproject.toml").read_text()
    assert 'moemesh = "moemesh.cli:main"' in scripts
    try:
        cli = importlib.import_module("moemesh.cli")
    except Exception as e:  # noqa: BLE001 - any import failure means the image's entrypoint is broken
        pytest.fail(f"moemesh.cli (the services image's `moemesh` entrypoint) does not import: {e!r}", pytrace=False)
    parser = cli.build_parser()
    subcommands = {
        name
        for action in parser._actions
        if hasattr(action, "choices") and isinstance(action.choices, dict)
        for name in action.choices
    }
    assert command[1] == "serve" and "serve" in subcommands, (
        f"`moemesh serve` missing; moemesh has {sorted(subcommands)}"
    )
    args = parser.parse_args(command[1:])  # as the console script parses its argv
    assert (args.role, args.config) == ("decode", "/etc/moemesh/mesh.json")

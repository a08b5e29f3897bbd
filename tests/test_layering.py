"""The import direction (kernels <- engine <- worker / expert; text and common below the engine;
router and operator free of the engine and of torch), checked on the source, and the router's
and operator's real start-up paths run without loading torch."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"moemesh.kernels": ROOT / "kernels", "moemesh.operator": ROOT / "operator", "moemesh": ROOT / "services"}
SERVICE_PARTS = ("engine", "router", "worker", "expert", "prefill", "decode", "launcher")

# package -> prefixes it must never import (at module level or lazily inside a function)
FORBIDDEN = {
    "moemesh.kernels": (
        "moemesh.engine",
        "moemesh.common",
        "moemesh.text",
        *(f"moemesh.{p}" for p in SERVICE_PARTS[1:]),
    ),
    "moemesh.text": ("torch", "moemesh.common", *(f"moemesh.{p}" for p in SERVICE_PARTS)),
    "moemesh.common": ("torch", *(f"moemesh.{p}" for p in SERVICE_PARTS)),
    "moemesh.engine": tuple(f"moemesh.{p}" for p in SERVICE_PARTS[1:]),
    "moemesh.router": (
        "torch",
        "moemesh.engine",
        "moemesh.worker",
        "moemesh.expert",
        "moemesh.prefill",
        "moemesh.decode",
        "moemesh.launcher",
        "moemesh.kernels",
    ),  # fmt: skip
    "moemesh.operator": (
        "torch",
        "moemesh.engine",
        "moemesh.worker",
        "moemesh.expert",
        "moemesh.prefill",
        "moemesh.decode",
        "moemesh.launcher",
        "moemesh.router",
        "moemesh.kernels",
    ),  # fmt: skip
}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if package == "moemesh" and parts[0] in ("kernels", "operator"):
                continue
            found[".".join((package, *(p for p in parts if p != "__init__")))] = path
    return found


def imported_names(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def owner(module: str) -> str | None:
    for package in sorted(FORBIDDEN, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    return None


def test_every_package_imports_only_downwards():
    violations = []
    for module, path in sorted(modules().items()):
        package = owner(module)
        if package is None:
            continue
        for name in sorted(imported_names(path)):
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[package]):
                violations.append(f"{module} imports {name}")
    assert violations == []


def test_the_checker_sees_lazy_imports_inside_functions(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from moemesh.engine.config import SpecConfig\n    import torch\n")
    assert {"moemesh.engine.config.SpecConfig", "torch"} <= imported_names(path)


ROUTER_STARTUP = """
import json, sys, threading, time, urllib.request, os

def report():
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen("http://127.0.0.1:%(port)d/live", timeout=1) as reply:
                if reply.status == 200:
                    break
        except OSError:
            time.sleep(0.1)
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "moemesh.engine")))
    print("REPORT " + json.dumps(loaded), flush=True)
    os._exit(0)

threading.Thread(target=report, daemon=True).start()
from moemesh.cli import main
main(["serve", "--role", "router", "--redis-url", "%(redis)s", "--host", "127.0.0.1",
      "--http-port", "%(port)d", "--grpc-port", "0", "--metrics-port", "0"])
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_report(code: str, cwd) -> list[str]:
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=dict(os.environ), capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    reports = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert reports, f"no report (exit {result.returncode}): {result.stderr[-2000:]}"
    return json.loads(reports[-1][len("REPORT ") :])


def test_the_router_serves_without_importing_torch_or_the_engine(redis_port, tmp_path):
    code = ROUTER_STARTUP % {"port": free_port(), "redis": f"redis://127.0.0.1:{redis_port}/0"}
    assert run_report(code, tmp_path) == []


OPERATOR_STARTUP = """
import asyncio, json, os, sys
import kmock, kopf

async def main():
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator):
        emulator.resources.load_bundled()
        emulator.resources["moemesh.io/v1alpha1/inferencemeshes"] = kmock.ResourceInfo(
            kind="InferenceMesh", singular="inferencemesh", namespaced=True,
            verbs={"get", "list", "watch", "create", "patch", "update", "delete"}, subresources={"status", "scale"})
        emulator.resources["v1/namespaces"].namespaced = False
        with open("kubeconfig", "w") as f:
            f.write("kind: Config\\ncurrent-context: mock\\n"
                    f"clusters: [{{name: mock, cluster: {{server: '{emulator.url!s}'}}}}]\\n"
                    "users: [{name: mock, user: {}}]\\n"
                    "contexts: [{name: mock, context: {cluster: mock, user: mock}}]\\n")
        os.environ["KUBECONFIG"] = os.path.abspath("kubeconfig")
        import moemesh.operator.main  # what `kopf run -m moemesh.operator.main` imports
        settings = kopf.OperatorSettings()
        settings.scanning.disabled = True
        settings.persistence.consistency_timeout = 0
        ready = asyncio.Event()
        task = asyncio.create_task(kopf.operator(settings=settings, namespaces=["ns1"], standalone=True,
                                                 ready_flag=ready))
        await asyncio.wait_for(ready.wait(), timeout=300)
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "moemesh.engine")))
        print("REPORT " + json.dumps(loaded), flush=True)
        task.cancel()
        os._exit(0)

asyncio.run(main())
"""


def test_the_operator_starts_without_importing_torch_or_the_engine(redis_port, tmp_path, monkeypatch):
    # outside the repository root, where the operator/ folder would shadow the stdlib `operator`
    monkeypatch.setenv("MOEMESH_REDIS_URL", f"redis://127.0.0.1:{redis_port}/0")
    assert run_report(textwrap.dedent(OPERATOR_STARTUP), tmp_path) == []


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_each_checked_package_exists(package):
    assert any(owner(m) == package for m in modules()), package


@pytest.mark.parametrize("device, imports_triton", [("cpu", False), ("cuda", True)])
def test_a_cpu_worker_runs_the_engine_without_importing_triton(device, imports_triton):
    """`moemesh serve` on a CPU device runs only the torch references, so it never pays Triton's
    import; on a CUDA device the kernels need it. The worker's entry module is replaced by one that
    imports the engine and reports what got loaded."""
    pytest.importorskip("triton")
    code = textwrap.dedent(f"""
        import sys, types
        fake = types.ModuleType("moemesh.worker.main")
        def main(settings):
            import moemesh.engine.llm_engine, moemesh.kernels.dispatch
            print("triton" in sys.modules, moemesh.kernels.dispatch.HAS_TRITON)
            return 0
        fake.main = main
        sys.modules["moemesh.worker.main"] = fake
        from moemesh.cli import main as cli_main
        sys.exit(cli_main(["serve", "--role", "decode", "--device", "{device}"]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "MOEMESH_TRITON"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(imports_triton)] * 2

"""The house's layers, checked on the source: every package of `moemesh` is named with the packages
it may import (module level or lazily inside a function), the torch-free packages import no torch,
and no import cycle exists between packages, between subpackages, or between the files of one
package. The router's and operator's real start-up paths run without loading torch.

Layers, from the bottom up (siblings never import each other):
    text | proto | kernels
    contracts | runtime | planning
    engine
    expert
    router | worker | operator
    launcher
    cli
The root module `moemesh` (services/__init__.py) is the offline API's facade: it loads the engine
lazily and nothing imports it.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib

import pytest

from moemesh.launcher.ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]

BOTTOM = ("moemesh.text", "moemesh.proto", "moemesh.kernels")
MIDDLE = ("moemesh.contracts", "moemesh.runtime", "moemesh.planning")
# package -> the moemesh packages it may import
ALLOWED: dict[str, set[str]] = {
    "moemesh.text": set(),
    "moemesh.proto": set(),
    "moemesh.kernels": set(),
    "moemesh.contracts": {"moemesh.text", "moemesh.proto"},
    "moemesh.runtime": {"moemesh.text", "moemesh.proto"},
    "moemesh.planning": {"moemesh.text", "moemesh.proto"},
    "moemesh.engine": {*BOTTOM, *MIDDLE},
    "moemesh.expert": {*BOTTOM, *MIDDLE, "moemesh.engine"},
    "moemesh.router": {"moemesh.text", "moemesh.proto", *MIDDLE},
    "moemesh.worker": {*BOTTOM, *MIDDLE, "moemesh.engine", "moemesh.expert"},
    "moemesh.operator": {"moemesh.text", "moemesh.proto", *MIDDLE},
    "moemesh.launcher": {
        *BOTTOM,
        *MIDDLE,
        "moemesh.engine",
        "moemesh.expert",
        "moemesh.router",
        "moemesh.worker",
        "moemesh.operator",
    },
    "moemesh.cli": {
        *BOTTOM,
        *MIDDLE,
        "moemesh.engine",
        "moemesh.expert",
        "moemesh.router",
        "moemesh.worker",
        "moemesh.operator",
        "moemesh.launcher",
    },
    "moemesh": {"moemesh.runtime", "moemesh.engine"},
}
TORCH_FREE = (
    "moemesh.text",
    "moemesh.proto",
    "moemesh.contracts",
    "moemesh.runtime",
    "moemesh.planning",
    "moemesh.router",
    "moemesh.operator",
)
THIRD_PARTY_TORCH = ("torch", "triton", "xgrammar", "transformers")


def modules() -> dict[str, pathlib.Path]:
    """Every module of the project: dotted name -> file (generated protobuf code excluded)."""
    found: dict[str, pathlib.Path] = {}
    for package, folder in sorted(PACKAGE_DIRS.items(), key=lambda item: -len(item[0])):
        for path in (ROOT / folder).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found.setdefault(".".join((package, *(p for p in parts if p != "__init__"))), path)
    return found


def imported_names(path: pathlib.Path, module: str = "", known: dict | None = None) -> set[str]:
    """What a file imports, anywhere in it: `import a.b` gives a.b; `from a import b` gives a.b
    where that is a module of the project (else a), and a.b as well for anything outside it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if path.name == "__init__.py" else 0)
                base = ".".join([*parts[:keep], *([node.module] if node.module else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if known is not None and base.startswith("moemesh"):
                    names.add(full if full in known else base)
                else:
                    names.update((base, full))
    return names


def package_of(module: str) -> str:
    """The layer a module belongs to: the longest name of ALLOWED that prefixes it."""
    for package in sorted(ALLOWED, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    raise AssertionError(f"{module} is in no layer: add its package to ALLOWED")


def project_edges() -> dict[str, set[str]]:
    """module -> the project modules it imports (the longest known prefix of each import)."""
    known = modules()
    edges: dict[str, set[str]] = {}
    for module, path in known.items():
        targets = set()
        for name in imported_names(path, module, known):
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                head = ".".join(parts[:i])
                if head in known:
                    if head != module:
                        targets.add(head)
                    break
        edges[module] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def collapsed(edges: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The graph of packages `depth` names deep (moemesh.engine.core at 3)."""

    def cut(module: str) -> str:
        return ".".join(module.split(".")[:depth])

    graph: dict[str, set[str]] = {}
    for source, targets in edges.items():
        for target in targets:
            if cut(source) != cut(target):
                graph.setdefault(cut(source), set()).add(cut(target))
    return graph


def test_every_package_imports_only_the_layers_below_it():
    violations = []
    for module, targets in sorted(project_edges().items()):
        package = package_of(module)
        for target in sorted(targets):
            other = package_of(target)
            if other != package and other not in ALLOWED[package]:
                violations.append(f"{module} imports {target}")
    assert violations == []


def test_the_torch_free_packages_import_no_torch():
    violations = []
    for module, path in sorted(modules().items()):
        if package_of(module) in TORCH_FREE:
            for name in sorted(imported_names(path, module)):
                if name.split(".")[0] in THIRD_PARTY_TORCH:
                    violations.append(f"{module} imports {name}")
    assert violations == []


def test_no_import_cycle_between_files_or_packages():
    edges = project_edges()
    assert cycles(edges) == [], "files"
    for depth in (2, 3, 4):
        assert cycles(collapsed(edges, depth)) == [], f"packages at depth {depth}"


def test_the_cycle_check_finds_a_cycle_through_lazy_imports(tmp_path):
    edges = {
        "moemesh.a.x": {"moemesh.b.y"},
        "moemesh.b.y": {"moemesh.b.z"},
        "moemesh.b.z": {"moemesh.a.w"},
        "moemesh.a.w": set(),
    }
    assert cycles(edges) == []
    assert cycles(collapsed(edges, 2)) == [["moemesh.a", "moemesh.b"]]
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from moemesh.engine.config import SpecConfig\n    import torch\n")
    assert {"moemesh.engine.config.SpecConfig", "torch"} <= imported_names(path)


def test_every_module_belongs_to_a_named_layer():
    for module in modules():
        package_of(module)  # raises for an unnamed package


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


def run_report(code: str, cwd) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=dict(os.environ), capture_output=True, text=True, timeout=600
    )
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


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_named_package_exists(package):
    assert any(package_of(m) == package for m in modules()), package


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

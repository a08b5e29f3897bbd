"""A kubelet for tests: starts the containers of a pod template exactly as written, as local
processes, and answers its probes the way the kubelet would.

What it does, per pod:
- volumes: configMap and secret keys become files (mode 0644) in a directory per volume;
  emptyDir is a fresh directory owned by the pod's user; persistentVolumeClaim is a host
  directory the test provides per claim name; hostPath is the host path itself;
- every container runs in its own mount namespace (`unshare --mount`, see `pod_exec.py`) with the
  volumes bind-mounted at their `mountPath` (read-only where the manifest says so) and an
  /etc/hosts that resolves the test's Service names, as the user of the pod's securityContext;
- env: `value`, downward-API `fieldRef` (metadata.name / metadata.namespace / status.podIP),
  `secretKeyRef`, `configMapKeyRef`; `$(VAR)` in command and args is expanded as the kubelet does;
- init containers run first, one after another, and must exit 0;
- probes: httpGet, grpc (grpc.health.v1 with the probe's `service`) and tcpSocket on the pod's
  IP (each pod has its own loopback address 127.0.0.N), with ports by name or number.
Mount points missing on this machine are created before the pod starts and removed after it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


class PodFailed(RuntimeError):
    """A container exited, or never became ready; the message carries the end of its log."""


@dataclass
class Node:
    """What the test's 'cluster' provides to every pod."""

    namespace: str
    workdir: Path
    configmaps: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> data
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> data (base64, as the API stores it)
    claims: dict[str, Path] = field(default_factory=dict)  # PVC name -> host directory
    hosts: dict[str, str] = field(default_factory=dict)  # DNS name -> IP (/etc/hosts of every pod)
    image_path: str = str(Path(sys.executable).parent)  # the image's PATH: this interpreter's bin/
    created_mount_points: list[Path] = field(default_factory=list)

    def add_objects(self, objects: list[dict]) -> None:
        for obj in objects:
            if obj.get("kind") == "ConfigMap":
                self.configmaps[obj["metadata"]["name"]] = dict(obj.get("data") or {})
            elif obj.get("kind") == "Secret":
                data = dict(obj.get("data") or {})
                data.update(
                    {k: base64.b64encode(v.encode()).decode() for k, v in (obj.get("stringData") or {}).items()}
                )
                self.secrets[obj["metadata"]["name"]] = data

    def ensure_mount_point(self, path: str, is_dir: bool) -> None:
        missing = []
        target = Path(path) if is_dir else Path(path).parent
        while not target.exists():
            missing.append(target)
            target = target.parent
        for directory in reversed(missing):
            directory.mkdir()
            self.created_mount_points.append(directory)
        if not is_dir and not Path(path).exists():
            Path(path).touch()
            self.created_mount_points.append(Path(path))

    def cleanup(self) -> None:
        for path in reversed(self.created_mount_points):
            with contextlib.suppress(OSError):
                path.unlink() if path.is_file() else path.rmdir()
        self.created_mount_points.clear()


class Pod:
    def __init__(self, name: str, template: dict, ip: str, node: Node):
        self.name, self.template, self.ip, self.node = name, template, ip, node
        self.spec = template["spec"]
        self.dir = node.workdir / name
        self.process: subprocess.Popen | None = None
        self.log_path = self.dir / "main.log"
        (container,) = self.spec["containers"]  # one container per pod in our manifests
        self.container = container
        self.terminated: dict | None = None  # {container, init, exitCode, message} once a container failed

    # -- volumes and environment ---------------------------------------------------------
    def _user(self) -> tuple[int | None, int | None]:
        context = {**(self.spec.get("securityContext") or {}), **(self.container.get("securityContext") or {})}
        return context.get("runAsUser"), context.get("runAsGroup")

    def _volumes(self) -> dict[str, Path]:
        uid, gid = self._user()
        paths = {}
        for volume in self.spec.get("volumes") or []:
            name = volume["name"]
            if "configMap" in volume or "secret" in volume:
                directory = self.dir / "volumes" / name
                directory.mkdir(parents=True)
                if "configMap" in volume:
                    data = self.node.configmaps[volume["configMap"]["name"]]
                else:
                    encoded = self.node.secrets[volume["secret"]["secretName"]]
                    data = {k: base64.b64decode(v).decode() for k, v in encoded.items()}
                for key, value in data.items():
                    (directory / key).write_text(value)
                    (directory / key).chmod(0o644)
                paths[name] = directory
            elif "emptyDir" in volume:
                directory = self.dir / "volumes" / name
                directory.mkdir(parents=True)
                if uid is not None:
                    os.chown(directory, uid, gid if gid is not None else -1)
                paths[name] = directory
            elif "persistentVolumeClaim" in volume:
                paths[name] = self.node.claims[volume["persistentVolumeClaim"]["claimName"]]
            elif "hostPath" in volume:
                paths[name] = Path(volume["hostPath"]["path"])
            else:
                raise NotImplementedError(f"volume kind of {volume}")
        return paths

    def _hosts_file(self) -> Path:
        path = self.dir / "hosts"
        lines = ["127.0.0.1 localhost", f"{self.ip} {self.name}"]
        lines += [f"{ip} {host}" for host, ip in self.node.hosts.items()]
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o644)
        return path

    def _env(self, container: dict) -> dict[str, str]:
        env = {
            "PATH": f"{self.node.image_path}:/usr/local/bin:/usr/bin:/bin",
            "HOSTNAME": self.name,
            "HOME": "/tmp",
            "PYTHONUNBUFFERED": "1",
        }
        for key in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "TRITON_INTERPRET"):  # this machine's, not the pod's
            if key in os.environ:
                env[key] = os.environ[key]
        for var in container.get("env") or []:
            if "value" in var:
                env[var["name"]] = expand(var["value"], env)
                continue
            source = var["valueFrom"]
            if "fieldRef" in source:
                field_path = source["fieldRef"]["fieldPath"]
                env[var["name"]] = {
                    "metadata.name": self.name,
                    "metadata.namespace": self.node.namespace,
                    "status.podIP": self.ip,
                }[field_path]
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                env[var["name"]] = base64.b64decode(self.node.secrets[ref["name"]][ref["key"]]).decode()
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                env[var["name"]] = self.node.configmaps[ref["name"]][ref["key"]]
            else:
                raise NotImplementedError(f"env source {source}")
        return env

    def _spec_file(self, container: dict, volumes: dict[str, Path], hosts: Path, kind: str) -> Path:
        mounts = [[str(hosts), "/etc/hosts", True]]
        for mount in container.get("volumeMounts") or []:
            source = volumes[mount["name"]]
            if mount.get("subPath"):
                source = source / mount["subPath"]
            self.node.ensure_mount_point(mount["mountPath"], source.is_dir())
            mounts.append([str(source), mount["mountPath"], bool(mount.get("readOnly"))])
        env = self._env(container)
        argv = [expand(a, env) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
        uid, gid = self._user() if image_runs_as_pod_user(self._user()[0]) else (None, None)
        image = sorted({str(ROOT), sys.prefix, sys.base_prefix, os.path.realpath(sys.executable).rsplit("/bin/", 1)[0]})
        spec = {
            "mounts": mounts,
            "uid": uid,
            "gid": gid,
            "argv": argv,
            "env": env,
            "image": image,
            "cwd": container.get("workingDir") or "/tmp",
        }
        path = self.dir / f"{kind}.json"
        path.write_text(json.dumps(spec))
        return path

    def _launch(self, spec_path: Path, log_path: Path) -> subprocess.Popen:
        log = open(log_path, "wb")
        argv = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            sys.executable,
            "-m",
            "tests.deploy.pod_exec",
            str(spec_path),
        ]
        return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> Pod:
        self.dir.mkdir(parents=True)
        volumes, hosts = self._volumes(), self._hosts_file()
        for init in self.spec.get("initContainers") or []:
            log_path = self.dir / f"init-{init['name']}.log"
            process = self._launch(self._spec_file(init, volumes, hosts, f"init-{init['name']}"), log_path)
            code = process.wait(timeout=600)
            if code != 0:
                self.terminated = {
                    "container": init["name"],
                    "init": True,
                    "exitCode": code,
                    "message": termination_message(log_path),
                }
                raise PodFailed(f"{self.name}: init container {init['name']} exited {code}: {tail(log_path)}")
        self.process = self._launch(self._spec_file(self.container, volumes, hosts, "main"), self.log_path)
        return self

    def wait_exit(self, timeout_s: float = 300.0) -> int:
        assert self.process is not None
        code = self.process.wait(timeout=timeout_s)
        if code != 0:
            self.terminated = {
                "container": self.container["name"],
                "init": False,
                "exitCode": code,
                "message": termination_message(self.log_path),
            }
        return code

    def port(self, name_or_number) -> int:
        if isinstance(name_or_number, int):
            return name_or_number
        for port in self.container.get("ports") or []:
            if port.get("name") == name_or_number:
                return port["containerPort"]
        raise KeyError(f"{self.name} declares no port {name_or_number!r}")

    def probe(self, kind: str) -> bool:
        probe = self.container.get(kind)
        if probe is None:
            return True
        try:
            if "httpGet" in probe:
                get = probe["httpGet"]
                url = f"http://{self.ip}:{self.port(get['port'])}{get.get('path', '/')}"
                with urllib.request.urlopen(url, timeout=2) as reply:
                    return 200 <= reply.status < 400
            if "grpc" in probe:
                check = probe["grpc"]
                with grpc.insecure_channel(f"{self.ip}:{check['port']}") as channel:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=check.get("service", "")), timeout=2
                    )
                return reply.status == health_pb2.HealthCheckResponse.SERVING
            if "tcpSocket" in probe:
                with socket.create_connection((self.ip, self.port(probe["tcpSocket"]["port"])), timeout=2):
                    return True
        except (OSError, urllib.error.URLError, grpc.RpcError):
            return False
        raise NotImplementedError(f"probe {probe}")

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Startup probe first (then liveness holds), then readiness, as the kubelet gates them."""
        deadline = time.monotonic() + timeout_s
        for kind in ("startupProbe", "readinessProbe"):
            while not self.probe(kind):
                if self.process.poll() is not None:
                    raise PodFailed(f"{self.name} exited {self.process.returncode}: {tail(self.log_path)}")
                if time.monotonic() > deadline:
                    raise PodFailed(f"{self.name}: {kind} did not pass in {timeout_s} s: {tail(self.log_path)}")
                time.sleep(0.2)
        assert self.probe("livenessProbe"), f"{self.name}: ready but not live"

    def stop(self, grace_s: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


_RUNNABLE: dict[int | None, bool] = {}


def image_runs_as_pod_user(uid: int | None) -> bool:
    """Whether this machine's interpreter (the stand-in image) is reachable by the pod's user; where
    it lives under a private home directory the containers run as root in their namespace instead."""
    if uid is None:
        return True
    if uid not in _RUNNABLE:
        try:
            probe = subprocess.run(
                [sys.executable, "-c", "import moemesh"],
                user=uid,
                group=uid,
                extra_groups=[],
                cwd="/",
                capture_output=True,
            )
            _RUNNABLE[uid] = probe.returncode == 0
        except PermissionError:
            _RUNNABLE[uid] = False
    return _RUNNABLE[uid]


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion ($$ escapes; unknown references stay as written)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def termination_message(path: Path) -> str:
    """terminationMessagePolicy FallbackToLogsOnError: the end of the log, at most 80 lines or 2048 bytes."""
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    lines = data.splitlines(keepends=True)[-80:]
    return b"".join(lines)[-2048:].decode(errors="replace")


def tail(path: Path, num_lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)

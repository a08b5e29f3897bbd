"""Runs one container of a pod inside a private mount namespace (started by `unshare --mount`):
bind-mounts each volume at its `mountPath` and the pod's /etc/hosts, drops to the pod's user,
then execs the container's command. Invoked as `python -m tests.deploy.pod_exec SPEC.json`.

SPEC: {"mounts": [[host_dir_or_file, mount_path, read_only]], "uid": int | null, "gid": int | null,
       "argv": [...], "env": {...}, "cwd": str | null, "image": [path, ...]}

`image` lists the directories that stand in for the container image here (the project checkout,
its virtualenv, the interpreter). A volume mounted over one of their parents (an emptyDir at
/tmp while the checkout lives under /tmp) would hide the image, which a real container keeps in
its own root filesystem: those directories are bound back at their own paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def mount(source: str | int, target: str, read_only: bool) -> None:
    """`source`: a path, or an O_PATH descriptor opened before any mount could hide the path."""
    is_dir = os.path.isdir(f"/proc/self/fd/{source}" if isinstance(source, int) else source)
    if is_dir:
        os.makedirs(target, exist_ok=True)  # the image's directory (an empty mount point if new)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            open(target, "a").close()
    if isinstance(source, int):
        # --no-canonicalize: mount(8) would resolve the magic link to a path string, which an earlier
        # mount may now hide (a source under /tmp once an emptyDir is mounted at /tmp)
        subprocess.run(
            ["mount", "--no-canonicalize", "--bind", f"/proc/self/fd/{source}", target], check=True, pass_fds=[source]
        )
    else:
        subprocess.run(["mount", "--bind", source, target], check=True)
    if read_only:
        subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    # every source is opened first: a mount at /tmp must not hide a source that lives under /tmp
    sources = [os.open(source, os.O_PATH) for source, _, _ in spec["mounts"]]
    image = {path: os.open(path, os.O_PATH) for path in spec.get("image") or [] if os.path.isdir(path)}
    for fd, (_, target, read_only) in zip(sources, spec["mounts"]):
        mount(fd, target, read_only)
    targets = [os.path.join(target, "") for _, target, _ in spec["mounts"]]
    bound: list[str] = []
    for path, fd in sorted(image.items()):
        hidden = any(path.startswith(target) for target in targets)
        if hidden and not any(path.startswith(os.path.join(b, "")) for b in bound):  # bind it back, once
            mount(fd, path, read_only=False)
            bound.append(path)
    for fd in [*sources, *image.values()]:
        os.close(fd)
    if spec.get("gid") is not None:
        os.setgroups([])
        os.setgid(spec["gid"])
    if spec.get("uid") is not None:
        os.setuid(spec["uid"])
    if spec.get("cwd"):
        os.chdir(spec["cwd"])
    argv, env = spec["argv"], spec["env"]
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print(f"pod_exec: cannot run {argv[0]!r}: {e}", file=sys.stderr, flush=True)
        sys.exit(127)


if __name__ == "__main__":
    main()

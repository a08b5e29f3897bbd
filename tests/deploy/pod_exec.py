"""Runs one container of a pod inside a private mount namespace (started by `unshare --mount`):
bind-mounts each volume at its `mountPath` and the pod's /etc/hosts, drops to the pod's user,
then execs the container's command. Invoked as `python -m tests.deploy.pod_exec SPEC.json`.

SPEC: {"mounts": [[host_dir_or_file, mount_path, read_only]], "uid": int | null, "gid": int | null,
       "argv": [...], "env": {...}, "cwd": str | null}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def mount(source: str, target: str, read_only: bool) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)  # the image's directory (an empty mount point if new)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            open(target, "a").close()
    subprocess.run(["mount", "--bind", source, target], check=True)
    if read_only:
        subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    for source, target, read_only in spec["mounts"]:
        mount(source, target, read_only)
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

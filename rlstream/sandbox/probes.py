"""What this machine offers a sandbox, probed once per process: user namespaces (``unshare -rnpfm``), a docker
engine, an image in it. The docker SDK is an optional dependency, imported only here and in ``containers``."""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading

#: The namespaces every subprocess sandbox is started in, where they work: user, net, pid and mount.
UNSHARE = ("unshare", "-r", "-n", "-p", "-f", "-m", "--kill-child")

_probe_lock, PROBES = threading.Lock(), {}


def namespaces_available() -> bool:
    """Whether ``unshare -rnpfm`` runs here (cached): root, or unprivileged user namespaces."""
    with _probe_lock:
        if "unshare" not in PROBES:
            ok = shutil.which("unshare") is not None
            if ok:
                try:
                    ok = subprocess.run([*UNSHARE, sys.executable, "-I", "-c", "pass"], capture_output=True,
                                        timeout=10).returncode == 0
                except (OSError, subprocess.TimeoutExpired):
                    ok = False
            PROBES["unshare"] = ok
        return PROBES["unshare"]


def docker_available() -> bool:
    """Whether the docker SDK is importable and an engine answers a ping (cached)."""
    with _probe_lock:
        if "docker" not in PROBES:
            try:
                import docker  # optional dependency
                PROBES["docker"] = bool(docker.from_env(timeout=5).ping())
            except Exception:
                PROBES["docker"] = False
        return PROBES["docker"]


def docker_image_present(image: str) -> bool:
    """Whether the engine already holds ``image`` (nothing is pulled: a sandbox must not wait on a registry)."""
    try:
        import docker
        docker.from_env(timeout=5).images.get(image)
        return True
    except Exception:
        return False

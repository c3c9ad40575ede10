"""Run untrusted Python snippets (tool calls, model-written code) with limits and without network.

Two backends. ``docker`` (when an engine answers): a throw-away container with
networking disabled and memory, CPU and pid limits. ``subprocess`` (the default
here): a child Python process with

- a wall-clock timeout that SIGKILLs the whole process group, and with
  namespaces the whole pid namespace (children that ``setsid()`` die too);
- ``setrlimit`` in ``preexec_fn``: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_CORE
  (not RLIMIT_NPROC: it counts every process of the uid system-wide, and root ignores it);
- a fresh temp dir as cwd, HOME and TMPDIR, removed afterwards (or the caller's ``workdir``, kept: an
  episode's workspace), and a minimal environment;
- no network: ``unshare -rnpfm`` (user, net, pid and mount namespaces) where it works, so
  the child has no interface at all, not even loopback; an audit hook blocks sockets too;
- files: an audit hook (installed through ``sitecustomize`` in every Python process of the
  sandbox) refuses ``open`` outside the temp dir and read-only Python library folders, and
  refuses starting programs other than Python, ``ctypes`` and gc introspection. With
  namespaces, HOME and the project folder are also covered by an empty tmpfs.

Audit hooks are not a security boundary against code written to escape them (PEP 578); the
namespaces and limits are. For adversarial code use the docker backend.
"""

from rlstream.sandbox.core import Sandbox, run_python
from rlstream.sandbox.limits import FAILURE_CLASSES, MEMORY_EXIT, SandboxLimits, SandboxResult, classify
from rlstream.sandbox.probes import docker_available, docker_image_present, namespaces_available

__all__ = ["FAILURE_CLASSES", "MEMORY_EXIT", "Sandbox", "SandboxLimits", "SandboxResult", "classify",
           "docker_available", "docker_image_present", "namespaces_available", "run_python"]

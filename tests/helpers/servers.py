"""Real vLLM OpenAI-compatible server processes for tests: started on a free port, waited for, killed."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VLLMServer:
    """One ``vllm.entrypoints.openai.api_server`` process (CPU, fp32, eager, one thread)."""

    proc: subprocess.Popen
    url: str
    log: Path

    def wait_ready(self, timeout_s: float = 300) -> "VLLMServer":
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2)
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM server exited ({self.proc.returncode}); see {self.log}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM server at {self.url} not up in {timeout_s}s; see {self.log}")
                time.sleep(1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


def start_vllm_server(folder: Path, log: Path, dev_mode: bool = True, max_model_len: int = 64,
                      extra: tuple[str, ...] = (), env_extra: dict | None = None) -> VLLMServer:
    """Start a server for ``folder`` (its weight routes on with ``dev_mode``; ``extra`` arguments after the usual
    ones, ``env_extra`` variables); call ``wait_ready`` before use."""
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               **(env_extra or {}))
    env.pop("VLLM_SERVER_DEV_MODE", None)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    out = open(log, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                             "--port", str(port), "--host", "127.0.0.1", "--max-model-len", str(max_model_len),
                             "--dtype", "float32", "--enforce-eager", "--seed", "0", *extra], env=env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return VLLMServer(proc, f"http://127.0.0.1:{port}", log)

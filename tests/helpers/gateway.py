"""``rlstream gateway`` processes for tests: started on a port, waited for, and the JSON calls of its session
routes."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from rlstream.infra.supervisor import StageProc, stage_env
from tests.helpers import ROOT
from tests.helpers.kafka import wait_for


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    """POST JSON; the status and the JSON answer (an error status too)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def health(base: str) -> dict | None:
    """The gateway's /health answer, None while it does not answer."""
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return None


def start_gateway(bootstrap: str, run: str, port: int, log: Path, home: Path, *args: str,
                  timeout: float = 300) -> StageProc:
    """A gateway on the transformers backend (6 new tokens a call unless asked), answering once it serves a
    policy version (the caller kills or stops it)."""
    proc = StageProc("gateway", ["gateway", "--port", str(port), "--backend", "transformers", "--max-tokens", "6",
                                 "--wait-policy-s", str(int(timeout)), "--home", str(home), *args],
                     stage_env(bootstrap, run), log, cwd=ROOT).start()
    try:
        wait_for(lambda: health(f"http://127.0.0.1:{port}") or not proc.alive(), timeout, "the gateway to answer")
    except AssertionError:
        proc.kill()
        raise
    assert proc.alive(), proc.log_tail()
    return proc

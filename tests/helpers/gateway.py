"""``rlstream gateway`` processes for tests (started on a port, waited for; the JSON calls of its session routes),
and stand-ins for its engine and writer in tests of its own bookkeeping."""
from __future__ import annotations

import functools
import json
import urllib.error
import urllib.request
from concurrent.futures import Future
from pathlib import Path

from rlstream.infra.supervisor import StageProc, stage_env
from rlstream.engine import Generation
from tests.helpers import ROOT
from tests.helpers.kafka import wait_for
from tests.helpers.models import chat_tokenizer


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


@functools.cache
def stand_in_tokenizer():
    return chat_tokenizer()


class StandInEngine:
    """The gateway engine's interface (tokenizer, context, version, generate) answering a scripted text per call,
    one token per character, for tests of the gateway's own bookkeeping and protocol, not of sampling."""

    def __init__(self, answers: list[str], version: int = 3):
        self.tokenizer, self.max_context, self.version = stand_in_tokenizer(), 512, version
        self.answers, self.prompts, self.streamed = list(answers), [], 0

    def generate(self, prompt, params, key, on_tokens=None):
        self.prompts.append(list(prompt))
        ids = engine_tokens(self.answers.pop(0))
        if on_tokens is not None:  # as a streaming engine: the tokens so far after each step, a token a step
            for n in range(1, len(ids) + 1):
                on_tokens(ids[:n])
                self.streamed += 1
        return Generation(ids, [-0.25] * len(ids), "stop", versions=[self.version] * len(ids)), self.version


def engine_tokens(text: str, eos: bool = True) -> list[int]:
    """Tokens an engine could have sampled for ``text``: one per character, which BPE would not give back."""
    tok = stand_in_tokenizer()
    return [tok.convert_tokens_to_ids(tok.tokenize(c))[0] for c in text] + ([tok.eos_token_id] if eos else [])


class KeptWriter:
    """The gateway writer's interface, keeping what it was given (committed at once)."""

    def __init__(self):
        self.written = []

    def submit(self, trajs, traceparent):
        self.written += trajs
        done = Future()
        done.set_result(len(trajs))
        return done

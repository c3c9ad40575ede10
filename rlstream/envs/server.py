"""``rlstream env-server``: an env plugin served over HTTP (the protocol is in ``rlstream.envs.remote``).

    rlstream env-server --env mypkg.envs:make --port 8765

Each episode's env and workspace live in this process from ``/reset`` to ``/close`` (at most
``--max-live-envs``; the least recently used is closed). Calls into the plugin run with ``--step-timeout-s``,
tools in this host's sandbox with the same limits as the env stage's. One request at a time per episode;
episodes run in parallel (a thread per request).

Repeats: a request whose ``Idempotency-Key`` this server already answered for an episode it still holds is not run
again. A repeated ``/step`` gets the answer the first one got (the plugin stepped once); a repeated ``/reset`` keeps
the env as it is. That is what an env stage killed mid-episode sends: its successor rebuilds the episode (reset, the
earlier actions, the redone one) under the same keys. A key seen with another action is refused (422), as the
draft asks. The answers are dropped with the env (close, eviction, a restart of this server), after which a repeat
runs again; requests without a key always run.
"""
from __future__ import annotations

import json
import logging
import signal
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, ClassVar

from rlstream.config import add_arguments, knob
from rlstream.config import load as load_settings
from rlstream.envs.api import Env, EnvFailure, load_factory
from rlstream.envs.live import LiveEnvs
from rlstream.envs.remote import KEY_HEADER, step_result_to_dict
from rlstream.errors import UsageError
from rlstream.sandbox import Sandbox, SandboxLimits
from rlstream.schemas.records import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvServerSettings:
    """The env server's knobs."""

    ROLE: ClassVar[str] = "ENV_SERVER"

    env: str = knob("", "The env plugin to serve: module:factory, make(task, workspace) -> Env (rlstream.envs.api)")
    host: str = knob("127.0.0.1", "Address to listen on (0.0.0.0: every interface)")
    port: int = knob(8765, "Port to listen on (0: any free port, printed at start)")
    step_timeout_s: float = knob(30.0, "Most seconds one reset/step/close of the plugin may take (then env_timeout)")
    max_live_envs: int = knob(1024, "Most episodes held; the least recently used is closed")
    workspace_root: str = knob("", "Folder for per-episode workspaces (default: the system temp dir)")
    tool_timeout_s: float = knob(5.0, "Wall-clock limit of one tool call")
    tool_memory_mb: int = knob(512, "Address-space limit of one tool call (MiB)")
    tool_cpu_s: float = knob(5.0, "CPU-time limit of one tool call (s)")
    max_output_bytes: int = knob(4096, "Tool output beyond this is cut (and marked truncated)")
    sandbox: str = knob("auto", "Tool sandbox: docker where an engine answers, else subprocess",
                        choices=("auto", "subprocess", "docker"))


class KeyReused(ValueError):
    """An Idempotency-Key seen before with another request (HTTP 422)."""


class EnvService:
    """The routes' logic, without HTTP: the episodes' envs by id, and the answers given under each key (module
    docstring: repeats)."""

    def __init__(self, factory: Callable[..., Env], s: EnvServerSettings):
        sandbox = Sandbox(SandboxLimits(timeout_s=s.tool_timeout_s, memory_mb=s.tool_memory_mb, cpu_s=s.tool_cpu_s,
                                        max_output_bytes=s.max_output_bytes), backend=s.sandbox)
        self.factory = factory
        self.live = LiveEnvs(sandbox, s.max_live_envs, s.step_timeout_s, s.workspace_root or None)
        # episode id -> key -> (the request's action, or None for a reset; the answer)
        self._answered: dict[str, dict[str, tuple[str | None, dict]]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self.repeats = 0  # requests answered from a key's record (for tests and logs)

    def _episode(self, episode_id: str) -> tuple[threading.Lock, dict]:
        """The episode's lock (a repeat waits for its first sending to finish) and its answers by key; the answers
        of episodes no longer held are dropped here."""
        with self._lock:
            if len(self._answered) > self.live.max_live:
                for gone in [e for e in self._answered if e != episode_id and not self._locks[e].locked()
                             and not self.live.holds(e)]:
                    del self._answered[gone], self._locks[gone]
            return self._locks.setdefault(episode_id, threading.Lock()), self._answered.setdefault(episode_id, {})

    def _repeat(self, answered: dict, key: str | None, action: str | None) -> dict | None:
        """The recorded answer of a repeated key, else None; KeyReused when the key came with another action."""
        if key is None or key not in answered:
            return None
        first, answer = answered[key]
        if first != action:
            raise KeyReused(f"{KEY_HEADER} {key} was sent before with another request")
        self.repeats += 1
        log.info("repeated request %s answered from its record", key)
        return answer

    def reset(self, body: dict, key: str | None = None) -> dict:
        episode_id, task = str(body["episode_id"]), Task.from_dict(body["task"])
        lock, answered = self._episode(episode_id)
        with lock:
            if self.live.holds(episode_id) and self._repeat(answered, key, None) is not None:
                return {}
            answered.clear()  # a new env: nothing it has done yet
            self.live.finish(episode_id)  # a reset replaces the episode's env
            self.live.open(self.factory, episode_id, task)
            if key is not None:
                answered[key] = (None, {})
            return {}

    def step(self, body: dict, key: str | None = None) -> dict:
        episode_id, action = str(body["episode_id"]), str(body["action"])
        lock, answered = self._episode(episode_id)
        with lock:
            if self.live.holds(episode_id) and (repeat := self._repeat(answered, key, action)) is not None:
                return repeat
            answer = step_result_to_dict(self.live.step_open(episode_id, action))
            if key is not None:
                answered[key] = (action, answer)
            return answer

    def close(self, body: dict, key: str | None = None) -> dict:
        episode_id = str(body["episode_id"])
        lock, answered = self._episode(episode_id)
        with lock:
            self.live.finish(episode_id)
            answered.clear()
        return {}


def serve(service: EnvService, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server for ``service`` (not yet serving: call ``serve_forever``)."""
    routes = {"/reset": service.reset, "/step": service.step, "/close": service.close}

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                return self._answer(200, {"ok": True})
            self._answer(404, {"error": f"no route {self.path}", "failure_class": "env_error"})

        def do_POST(self):  # noqa: N802
            route = routes.get(self.path)
            if route is None:
                return self._answer(404, {"error": f"no route {self.path}", "failure_class": "env_error"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            except ValueError as exc:
                return self._answer(400, {"error": f"not JSON: {exc}", "failure_class": "env_error"})
            key = (self.headers.get(KEY_HEADER) or "").strip().strip('"') or None
            try:
                status, answer = 200, route(body, key)
            except KeyReused as exc:
                status, answer = 422, {"error": str(exc), "failure_class": "env_error"}
            except EnvFailure as exc:
                status, answer = (404 if exc.failure_class == "env_lost" else 500,
                                  {"error": str(exc), "failure_class": exc.failure_class})
            except (KeyError, TypeError, ValueError) as exc:
                status, answer = 400, {"error": f"bad request: {exc!r}", "failure_class": "env_error"}
            except Exception as exc:  # the env's own bug: that episode's problem, never the server's
                log.exception("env server: %s failed", self.path)
                status, answer = 500, {"error": f"{type(exc).__name__}: {exc}", "failure_class": "env_error"}
            try:
                self._answer(status, answer)
            except (BrokenPipeError, ConnectionResetError):
                # The caller is gone (an env stage killed mid-call): its successor repeats the call under its key.
                log.info("env server: the caller of %s %s left before the answer", self.path, key)

        def log_message(self, fmt, *args):
            log.debug("%s " + fmt, self.address_string(), *args)

    return ThreadingHTTPServer((host, port), Handler)


def cmd_env_server(args) -> None:
    s = load_settings(EnvServerSettings, args)
    if not s.env:
        raise UsageError("--env is required: the plugin to serve, module:factory")
    try:
        factory = load_factory(s.env)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    service = EnvService(factory, s)
    httpd = serve(service, s.host, s.port)
    print(f"env server for {s.env} on http://{httpd.server_address[0]}:{httpd.server_address[1]}", flush=True)

    def stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)  # a stopped server still removes its workspaces
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        service.live.close_all()  # workspaces go with the server


def add_command(subparsers) -> None:
    """``rlstream env-server --env module:factory [--port P]``."""
    p = subparsers.add_parser("env-server", help="serve an env plugin over HTTP (reset, step, close) for --env-url")
    add_arguments(p, EnvServerSettings)
    p.set_defaults(func=cmd_env_server)

"""``rlstream env-server``: an env plugin served over HTTP (the protocol is in ``rlstream.envs.remote``).

    rlstream env-server --env mypkg.envs:make --port 8765

Each episode's env and workspace live in this process from ``/reset`` to ``/close`` (at most
``--max-live-envs``; the least recently used is closed). Calls into the plugin run with ``--step-timeout-s``,
tools in this host's sandbox with the same limits as the env stage's. One request at a time per episode;
episodes run in parallel (a thread per request).
"""
from __future__ import annotations

import json
import logging
import signal
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, ClassVar

from rlstream.config import add_arguments, knob
from rlstream.config import load as load_settings
from rlstream.envs.api import Env, EnvFailure, load_factory
from rlstream.envs.live import LiveEnvs
from rlstream.envs.remote import step_result_to_dict
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


class EnvService:
    """The routes' logic, without HTTP: the episodes' envs by id."""

    def __init__(self, factory: Callable[..., Env], s: EnvServerSettings):
        sandbox = Sandbox(SandboxLimits(timeout_s=s.tool_timeout_s, memory_mb=s.tool_memory_mb, cpu_s=s.tool_cpu_s,
                                        max_output_bytes=s.max_output_bytes), backend=s.sandbox)
        self.factory = factory
        self.live = LiveEnvs(sandbox, s.max_live_envs, s.step_timeout_s, s.workspace_root or None)

    def reset(self, body: dict) -> dict:
        episode_id, task = str(body["episode_id"]), Task.from_dict(body["task"])
        self.live.finish(episode_id)  # a reset replaces the episode's env
        self.live.open(self.factory, episode_id, task)
        return {}

    def step(self, body: dict) -> dict:
        return step_result_to_dict(self.live.step_open(str(body["episode_id"]), str(body["action"])))

    def close(self, body: dict) -> dict:
        self.live.finish(str(body["episode_id"]))
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
            try:
                self._answer(200, route(body))
            except EnvFailure as exc:
                self._answer(404 if exc.failure_class == "env_lost" else 500,
                             {"error": str(exc), "failure_class": exc.failure_class})
            except (KeyError, TypeError, ValueError) as exc:
                self._answer(400, {"error": f"bad request: {exc!r}", "failure_class": "env_error"})
            except Exception as exc:  # the env's own bug: that episode's problem, never the server's
                log.exception("env server: %s failed", self.path)
                self._answer(500, {"error": f"{type(exc).__name__}: {exc}", "failure_class": "env_error"})

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

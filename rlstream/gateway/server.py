"""``rlstream gateway``: the OpenAI-compatible capture server, its settings and its HTTP routes.

    rlstream gateway --run R --port 8780          # then point any agent at base_url http://host:8780/v1

Routes (JSON):

- ``POST /v1/sessions`` ``{"session_id"?, "group_id"?, "group_size"?, "sample_index"?, "task_name"?, "answer"?,
  "metadata"?}`` -> 201 ``{"session_id", "group_id"}``: open an episode (the agent's harness does this);
- ``POST /v1/chat/completions`` and ``POST /v1/completions``: OpenAI's, ``stream`` included (tokens as the
  engine samples them: ``rlstream.gateway.streaming``); the session is the ``X-Session-Id`` header, else the ``user`` field;
- ``POST /v1/sessions/{id}/close`` ``{"reward"?: number}`` -> ``{"trajectories": n, "calls": n}`` once committed:
  the episode goes to ``trajectories``; a posted reward travels in its task's metadata (``gateway.reward``) for
  the reward stage's ``rlstream.gateway.reward:posted``, else the reward stage's own function scores it;
- ``GET /v1/models``, ``GET /health``.

Errors are OpenAI-shaped (``{"error": {"message", "type", "code"}}``): 404 for an unknown session, 409 for a
closed one, 400 for a request the gateway cannot serve, each saying what to do.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

from rlstream.config import KafkaSettings, LoopSettings, add_arguments, knob
from rlstream.config import load as load_settings
from rlstream.errors import UsageError
from rlstream.gateway.sessions import SessionBook, SessionError
from rlstream.gateway.streaming import stream
from rlstream.engine.settings import EngineSettings

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"


@dataclass(frozen=True)
class GatewaySettings(EngineSettings):
    """The gateway's knobs: the engine's (``rlstream.engine.settings``, as rollout's), and these."""

    ROLE: ClassVar[str] = "GATEWAY"

    host: str = knob("127.0.0.1", "Address to listen on (0.0.0.0: every interface)")
    port: int = knob(8780, "Port to listen on (0: any free port, printed at start)")
    max_tokens: int = knob(256, "New tokens of a call that names no max_tokens")
    session_timeout_s: float = knob(600.0, "A session without a call or a close for this long is written as failed "
                                           "(gateway_timeout)")
    auto_open: bool = knob(False, "Open a session on its first call instead of refusing an unknown session id")
    instance: str = knob("0", "Stable gateway id: its transactional id is <run>.gateway.<instance>; a restarted "
                              "gateway with the same id aborts what a killed one left open (several gateways of "
                              "one run: give each its own, or the newest fences the others)")
    commit_pause_s: float = knob(0.0, "Seconds each transaction waits before its commit (tests kill inside it)")
    workers: int = knob(64, "Calls handled at once (threads); the engine batches those that wait together")
    max_batch: int = knob(32, "Most calls generated together in one engine batch")
    batch_wait_s: float = knob(0.005, "How long the engine waits for more calls to join a batch")


def _error(status: int, message: str):
    from aiohttp import web
    kind = {404: "not_found_error", 409: "conflict_error", 500: "server_error"}.get(status, "invalid_request_error")
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def make_app(gateway, workers: int = 16):
    """The aiohttp application of a ``rlstream.gateway.service.Gateway``."""
    from aiohttp import web
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gateway-call")

    async def in_thread(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def body_of(request) -> dict:
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError as exc:
            raise SessionError(400, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise SessionError(400, "the body must be a JSON object")
        return body

    def route(fn):
        async def handler(request):
            try:
                return await fn(request)
            except SessionError as exc:
                return _error(exc.status, str(exc))
            except Exception as exc:  # the engine's or the writer's fault: the agent gets a message, not a hang
                log.exception("gateway: %s failed", request.path)
                return _error(500, f"{type(exc).__name__}: {exc}")
        return handler

    async def call(request, method):
        body = await body_of(request)
        sid = request.headers.get(SESSION_HEADER) or body.get("user")
        if body.get("stream"):
            return await stream(request, in_thread, method, sid, body, gateway.engine.tokenizer)
        return web.json_response(await in_thread(method, sid, body))

    @route
    async def chat_completions(request):
        return await call(request, gateway.chat)

    @route
    async def completions(request):
        return await call(request, gateway.completion)

    @route
    async def open_session(request):
        return web.json_response(gateway.open(await body_of(request)), status=201)

    @route
    async def close_session(request):
        return web.json_response(await in_thread(gateway.close, request.match_info["sid"], await body_of(request)))

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": gateway.model, "object": "model",
                                                              "owned_by": "rlstream",
                                                              "policy_version": gateway.engine.version}]})

    async def health(request):
        return web.json_response({"ok": True, "policy_version": gateway.engine.version,
                                  "sessions": len(gateway.book)})

    app = web.Application()
    app.add_routes([web.post("/v1/chat/completions", chat_completions), web.post("/v1/completions", completions),
                    web.post("/v1/sessions", open_session), web.post("/v1/sessions/{sid}/close", close_session),
                    web.get("/v1/models", models), web.get("/health", health)])

    async def reap(app):
        async def loop():
            while True:
                await asyncio.sleep(min(5.0, max(0.2, gateway.book.timeout_s / 4)))
                try:
                    await in_thread(gateway.expire)
                except Exception:  # the writer's fault is logged there; keep reaping
                    log.exception("gateway: expiring sessions failed")
        task = asyncio.create_task(loop())
        yield
        task.cancel()
        await in_thread(gateway.stop)
        pool.shutdown(wait=False)
    app.cleanup_ctx.append(reap)
    return app


def cmd_gateway(args) -> None:
    from aiohttp import web

    from rlstream import metrics
    from rlstream.gateway.engine import PolicyEngine
    from rlstream.gateway.service import Gateway
    from rlstream.gateway.writer import TrajectoryWriter
    from rlstream.runtime.settings import RuntimeSettings
    s, loop, kafka, runtime = (load_settings(c, args) for c in (GatewaySettings, LoopSettings, KafkaSettings,
                                                                 RuntimeSettings))
    for name in ("session_timeout_s", "max_tokens", "workers", "max_batch"):
        if getattr(s, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    metrics.serve(runtime.metrics_port, runtime.metrics_addr)
    writer = TrajectoryWriter(kafka, s.instance, s.commit_pause_s)
    writer.start()  # first: a killed predecessor's open transaction is aborted before anything new
    engine = PolicyEngine(s, loop, kafka)
    engine.start()
    gateway = Gateway(engine, SessionBook(s.session_timeout_s, s.auto_open), writer, s.max_tokens, loop.policy)

    async def main():
        runner = web.AppRunner(make_app(gateway, s.workers))
        await runner.setup()
        site = web.TCPSite(runner, s.host, s.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        print(f"gateway for run {kafka.run} on http://{host}:{port}/v1 ({engine.backend.name}, policy "
              f"v{engine.version})", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()  # open sessions are written as failed (gateway_stopped)
    try:
        asyncio.run(main())
    finally:
        writer.close()
        engine.close()


def add_command(subparsers) -> None:
    """``rlstream gateway [--port P] [--backend B ...]``."""
    p = subparsers.add_parser("gateway", help="serve the OpenAI API in front of the policy; agents' calls become "
                                              "trajectories")
    add_arguments(p, LoopSettings, only=("run", "policy", "home"))
    add_arguments(p, KafkaSettings)
    from rlstream.runtime.settings import RuntimeSettings
    add_arguments(p, RuntimeSettings, only=("metrics_port", "metrics_addr"))
    add_arguments(p, GatewaySettings)
    p.set_defaults(func=cmd_gateway)

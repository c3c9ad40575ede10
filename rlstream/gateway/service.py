"""The gateway's calls without HTTP: a chat or completion call in a session, and closing sessions.

A call runs in a worker thread holding its session's lock (an episode's calls extend one another, so they are
taken one at a time); its new tokens join the session only once the engine answered, so a call that fails leaves
the episode as it was.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from rlstream import metrics
from rlstream.gateway import chat
from rlstream.gateway.sessions import Segment, Session, SessionBook, SessionError
from rlstream.schemas.headers import now_ms
from rlstream.schemas.records import Failure, SamplingParams

log = logging.getLogger(__name__)


def sampling(body: dict, default_max_tokens: int) -> SamplingParams:
    """The request's sampling parameters (OpenAI names); SessionError 400 for what the gateway cannot honour."""
    if body.get("n") not in (None, 1):
        raise SessionError(400, "n must be 1: run the agent once per sample, each in its own session of one group")
    stop = body.get("stop") or []
    given = lambda name, default: default if body.get(name) is None else body[name]  # noqa: E731
    try:
        return SamplingParams(temperature=float(given("temperature", 1.0)), top_p=float(given("top_p", 1.0)),
                              top_k=int(given("top_k", -1)),
                              max_tokens=int(body.get("max_completion_tokens") or body.get("max_tokens")
                                             or default_max_tokens),
                              seed=None if body.get("seed") is None else int(body["seed"]),
                              stop=[stop] if isinstance(stop, str) else [str(s) for s in stop])
    except (TypeError, ValueError) as exc:
        raise SessionError(400, f"bad sampling parameter: {exc}") from None


def cut_at_stop(tok, gen, stop: list[str]) -> str:
    """The answer's text, ended before the first stop string (OpenAI's ``stop``); ``gen`` is cut after the token
    that completed it (those tokens were sampled and stay in the episode; the rest are dropped)."""
    text = tok.decode(gen.token_ids, skip_special_tokens=True)
    hits = [(text.find(s), len(s)) for s in stop if s and s in text]
    if not hits:
        return text
    end, length = min(hits)
    for n in range(1, len(gen.token_ids) + 1):
        if len(tok.decode(gen.token_ids[:n], skip_special_tokens=True)) >= end + length:
            break
    gen.token_ids, gen.logprobs, gen.versions = gen.token_ids[:n], gen.logprobs[:n], gen.versions[:n]
    gen.finish_reason = "stop"
    return text[:end]


class Gateway:
    """Sessions, the engine and the writer, and what one call does with them."""

    def __init__(self, engine, book: SessionBook, writer, max_tokens: int = 256, model: str = "policy"):
        self.engine, self.book, self.writer = engine, book, writer
        self.max_tokens, self.model = max_tokens, model

    # -- calls ---------------------------------------------------------------------------------------------------

    def chat(self, sid: str | None, body: dict, on_tokens=None) -> dict:
        """One ``/v1/chat/completions`` call in session ``sid``: the OpenAI response (with an ``rlstream`` part).
        ``on_tokens``: called with the token ids sampled so far as the engine samples them (streaming)."""
        try:
            messages = chat.normalize(body.get("messages"))
        except chat.ChatError as exc:
            raise SessionError(400, str(exc)) from None
        tools = body.get("tools") or None
        params = sampling(body, self.max_tokens)
        session = self.book.get(sid)
        tok = self.engine.tokenizer
        with session.lock:
            seg, key = session.current, json.dumps(tools, sort_keys=True) if tools else ""
            try:
                cont = (chat.continuation(tok, seg.messages, seg.ended_with_eos, messages, tools)
                        if seg is not None and seg.kind == "chat" and seg.tools == key else None)
                fresh = None if cont is not None else chat.prompt_ids(tok, messages, tools)
            except chat.ChatError as exc:
                raise SessionError(400, str(exc)) from None
            except Exception as exc:  # the template's own error (jinja): the request's shape does not fit it
                raise SessionError(400, f"the chat template cannot render these messages: {exc}") from None
            if fresh is not None:
                seg = Segment("chat", fresh[0], fresh[1], params, tools=key)
            text, gen, version, added, started = self._generate(session, seg, cont, params, on_tokens)
            content, calls = chat.parse_tool_calls(text) if tools else (text, [])
            message = chat.assistant_message(content, calls)
            seg.messages = messages + chat.normalize([message])
            finish = "tool_calls" if calls else ("stop" if gen.finish_reason == "stop" else "length")
            choice = {"index": 0, "message": message, "finish_reason": finish,
                      "logprobs": self._logprobs(gen, body.get("logprobs"), chat=True)}
            return self._answer(session, seg, "chat.completion", choice, gen, version, added, fresh is not None,
                                started, body)

    def completion(self, sid: str | None, body: dict, on_tokens=None) -> dict:
        """One ``/v1/completions`` call in session ``sid``."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and prompt
                                                and all(isinstance(t, int) for t in prompt)):
            raise SessionError(400, "prompt must be one string or one list of token ids")
        params = sampling(body, self.max_tokens)
        session = self.book.get(sid)
        tok = self.engine.tokenizer
        with session.lock:
            seg, cont, fresh = session.current, None, None
            if isinstance(prompt, list):  # token ids: the agent's own, taken as they are
                fresh = (tok.decode(prompt), [int(t) for t in prompt])
            elif seg is not None and seg.kind == "completion" and not seg.ended_with_eos and \
                    prompt.startswith(seg.text):
                rest = prompt[len(seg.text):]
                cont = (rest, chat.ids(tok, rest) if rest else [])
            else:
                fresh = (prompt, [int(i) for i in tok(prompt)["input_ids"]])
            if fresh is not None:
                seg = Segment("completion", fresh[0], fresh[1], params)
            text, gen, version, added, started = self._generate(session, seg, cont, params, on_tokens)
            seg.text = (prompt if isinstance(prompt, str) else fresh[0]) + text
            choice = {"index": 0, "text": text, "finish_reason": "stop" if gen.finish_reason == "stop" else "length",
                      "logprobs": self._logprobs(gen, body.get("logprobs") is not None, chat=False)}
            return self._answer(session, seg, "text_completion", choice, gen, version, added, fresh is not None,
                                started, body)

    def _generate(self, session: Session, seg: Segment, cont, params: SamplingParams, on_tokens=None):
        """Sample after ``seg``'s tokens (and ``cont``, the agent's new context); the segment is changed only once
        the engine answered."""
        added = cont[1] if cont else []
        prompt = seg.prompt_ids + seg.token_ids + added
        room = self.engine.max_context - len(prompt)
        if room <= 0:
            raise SessionError(400, f"the episode's {len(prompt)} tokens fill the policy's context "
                                    f"({self.engine.max_context}); close the session")
        params.max_tokens = min(params.max_tokens, room)
        started = now_ms()
        gen, version = self.engine.generate(prompt, params, session.session_id, on_tokens)
        finished = now_ms()
        metrics.HANDLER_SECONDS.labels("gateway").observe((finished - started) / 1000)
        if cont is not None:
            seg.add_context(cont[0], cont[1], started)
        elif seg is not session.current:
            session.segments.append(seg)
        text = cut_at_stop(self.engine.tokenizer, gen, params.stop)
        version = seg.add_generation(text, gen, version, self.engine.tokenizer.eos_token_id, started, finished)
        session.calls += 1
        return text, gen, version, added, started

    def _logprobs(self, gen, wanted, chat: bool) -> dict | None:
        if not wanted:
            return None
        tokens = [self.engine.tokenizer.decode([t]) for t in gen.token_ids]
        if chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(tokens, gen.logprobs)]}
        return {"tokens": tokens, "token_logprobs": list(gen.logprobs), "top_logprobs": None, "text_offset": []}

    def _answer(self, session, seg, kind, choice, gen, version, added, fresh, started, body) -> dict:
        prompt_tokens = len(seg.prompt_ids) + len(seg.token_ids) - len(gen.token_ids)
        out: dict[str, Any] = {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
            "created": int(time.time()), "model": body.get("model") or self.model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(gen.token_ids),
                      "total_tokens": prompt_tokens + len(gen.token_ids)},
            # What was captured, for agents and tests that want to see it (OpenAI clients ignore it).
            "rlstream": {"session_id": session.session_id, "segment": len(session.segments) - 1,
                         "policy_version": version, "chained": not fresh, "context_token_ids": added,
                         "token_ids": list(gen.token_ids), "logprobs": list(gen.logprobs)}}
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = seg.prompt_ids + seg.token_ids[:len(seg.token_ids) - len(gen.token_ids)]
        return out

    # -- sessions ------------------------------------------------------------------------------------------------

    def open(self, spec: dict) -> dict:
        session = self.book.open(spec)
        return {"session_id": session.session_id, "group_id": session.group_id}

    def close(self, sid: str, body: dict, timeout_s: float = 120.0) -> dict:
        """Close a session (with ``reward`` when the agent's harness scored it) and wait for its commit."""
        reward = body.get("reward") if isinstance(body, dict) else None
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise SessionError(400, f"reward must be a number, not {reward!r}")
        session = self.book.close(sid)
        with session.lock:  # a call still running finishes first
            trajs = session.trajectories(reward=reward)
        n = self.writer.submit(trajs, session.traceparent).result(timeout_s)
        return {"session_id": sid, "trajectories": n, "calls": session.calls}

    def expire(self) -> int:
        """Write sessions idle past the timeout as failed (``gateway_timeout``); how many."""
        sessions = self.book.expired()
        for session in sessions:
            self._fail(session, "gateway_timeout", f"no call and no close for {self.book.timeout_s:g}s")
        return len(sessions)

    def stop(self) -> None:
        """A clean stop: the open sessions are written as failed (``gateway_stopped``), not lost."""
        self.book.timeout_s = -1.0
        pending = [self._fail(s, "gateway_stopped", "the gateway stopped before the session was closed")
                   for s in self.book.expired()]
        for done in pending:
            try:
                done.result(60)
            except Exception as exc:  # stopping anyway; the log says what was not written
                log.error("a stopped session was not written: %s", exc)

    def _fail(self, session: Session, failure_class: str, why: str):
        trajs = session.trajectories(failure=Failure(failure_class, why, "gateway"))
        if trajs:
            metrics.FAILURES.labels("gateway", failure_class).inc(len(trajs))
            log.warning("session %s: %s (%d calls)", session.session_id, why, session.calls)
        return self.writer.submit(trajs, session.traceparent)

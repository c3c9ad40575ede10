"""Streamed answers (``"stream": true``): the engine's tokens as server-sent events as they are sampled.

The call runs as any other (the same session bookkeeping, the same captured token ids and log-probs: the
trajectory never depends on whether the agent streamed); the engine hands the tokens sampled so far to the call's
listener after every engine step, and the text they decode to goes out as OpenAI chunks (``delta.content`` for
chat, ``text`` for completions). A backend that does not stream (a server fleet) answers whole: one text chunk.

What must not be streamed is held back until the answer is whole, because the final answer may cut it: text that
could be the start of a ``stop`` string, an incomplete UTF-8 character, and, when the request gave ``tools``, all
from a ``<tool_call>`` on (it becomes ``tool_calls``, not content). The last chunks carry what the whole answer
adds to what was streamed, the tool calls, the finish reason, usage and the ``rlstream`` capture.

An error before the first token (an unknown session, a bad request) is an ordinary error answer, not a stream.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from rlstream.gateway.chat import TOOL_CALL_OPEN


class TextDeltas:
    """Token ids so far -> the text that may be sent now (see the module docstring for what is held back)."""

    def __init__(self, tokenizer, stop: list[str], tools: bool):
        self.tok, self.sent, self.closed = tokenizer, "", False
        self.markers = [s for s in stop if s] + ([TOOL_CALL_OPEN] if tools else [])

    def feed(self, token_ids: list[int]) -> str:
        if self.closed:
            return ""
        text = self.tok.decode(token_ids, skip_special_tokens=True)
        cut = [text.find(m) for m in self.markers if m in text]
        if cut:
            text, self.closed = text[:min(cut)], True  # nothing after a stop or a tool call is content
        else:
            text = text.rstrip("\ufffd")  # a character whose bytes are not all sampled yet
            hold = max((k for m in self.markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
            text = text[:len(text) - hold]
        if not text.startswith(self.sent) or len(text) == len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def rest(self, final: str | None) -> str:
        """What the whole answer's text adds to what was sent ('' if it does not extend it)."""
        final = final or ""
        return final[len(self.sent):] if final.startswith(self.sent) else ""


def _chunk(base: dict, choice: dict, **extra) -> bytes:
    chat = base["object"] == "chat.completion"
    part = {**{k: base[k] for k in ("id", "created", "model")},
            "object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice], **extra}
    return f"data: {json.dumps(part)}\n\n".encode()


def _delta(chat: bool, text: str) -> dict:
    return {"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None} if chat else \
        {"index": 0, "text": text, "finish_reason": None}


async def stream(request, run, method, sid: str | None, body: dict, tokenizer):
    """Run ``method(sid, body, on_tokens)`` in a worker thread (``run``) and answer with its tokens as events."""
    from aiohttp import web
    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue = asyncio.Queue()
    chat = "messages" in body
    stop = body.get("stop") or []
    deltas = TextDeltas(tokenizer, [stop] if isinstance(stop, str) else [str(s) for s in stop],
                        tools=chat and bool(body.get("tools")))
    # The engine thread's tokens reach this loop in order, and before the call's own completion does.
    call = asyncio.ensure_future(run(method, sid, body,
                                     lambda ids: loop.call_soon_threadsafe(arrived.put_nowait, ids)))
    waiting = asyncio.ensure_future(arrived.get())
    await asyncio.wait({call, waiting}, return_when=asyncio.FIRST_COMPLETED)
    if not waiting.done() and call.exception() is not None:
        waiting.cancel()
        return call.result()  # raises: the route answers with the error (no token was sampled)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": body.get("model") or "", "object": "chat.completion" if chat else "text_completion"}

    async def send(ids: list[int]) -> None:
        text = deltas.feed(ids)
        if text:
            await resp.write(_chunk(base, _delta(chat, text)))
    try:
        while True:
            if waiting.done():
                await send(waiting.result())
                waiting = asyncio.ensure_future(arrived.get())
                continue
            await asyncio.wait({call, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if call.done() and not waiting.done():
                waiting.cancel()
                while not arrived.empty():
                    await send(arrived.get_nowait())
                break
        answer = call.result()
    except Exception as exc:  # the engine failed mid-answer: the stream ends with an error event
        waiting.cancel()
        await resp.write(f"data: {json.dumps({'error': {'message': f'{type(exc).__name__}: {exc}'}})}\n\n".encode())
        await resp.write_eof()
        return resp
    choice = answer["choices"][0]
    if chat:
        message = choice["message"]
        rest = deltas.rest(message.get("content"))
        if rest:
            await resp.write(_chunk(base, _delta(True, rest)))
        calls = [{"index": i, **c} for i, c in enumerate(message.get("tool_calls") or [])]
        if calls:
            await resp.write(_chunk(base, {"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}))
        last = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
    else:
        rest = deltas.rest(choice["text"])
        if rest:
            await resp.write(_chunk(base, _delta(False, rest)))
        last = {"index": 0, "text": "", "finish_reason": choice["finish_reason"]}
    await resp.write(_chunk(base, last, usage=answer["usage"], rlstream=answer["rlstream"]))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp

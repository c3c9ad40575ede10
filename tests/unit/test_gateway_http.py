"""The gateway's HTTP protocol as the real ``openai`` client sees it (the engine a stand-in answering scripted text,
so that what is tested is the protocol): tool calls out as OpenAI tool_calls and back untouched, streaming, and
every refusal a 4xx with its message."""
from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest

from rlstream.gateway.server import make_app
from rlstream.gateway.service import Gateway
from rlstream.gateway.sessions import SessionBook
from tests.helpers.agent import TOOLS
from tests.helpers.gateway import KeptWriter, StandInEngine, post

CALL = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'


@pytest.fixture
def serve():
    """Serve a Gateway on a free port in a thread; its base URL."""
    started = []

    def start(gateway: Gateway) -> str:
        from aiohttp import web
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(make_app(gateway, workers=4))
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        threading.Thread(target=loop.run_forever, name="gateway-test", daemon=True).start()
        started.append((loop, runner))
        return f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield start
    for loop, runner in started:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


def test_tool_calls_pass_through_streaming_works_and_refusals_say_why(serve):
    engine = StandInEngine(["Let me add." + CALL, "It is 42.", "unused"])
    writer = KeptWriter()
    base = serve(Gateway(engine, SessionBook(60), writer, model="policy"))
    assert post(base + "/v1/sessions", {"session_id": "s", "group_id": "g"})[0] == 201
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", default_headers={"X-Session-Id": "s"},
                           max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    first = client.chat.completions.create(model="anything", messages=messages, tools=TOOLS, logprobs=True)
    choice = first.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Let me add.")
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "add",
                                                                                    {"a": 12, "b": 30})
    assert [t.logprob for t in choice.logprobs.content] == [-0.25] * len(choice.logprobs.content)
    assert first.usage.completion_tokens == len(choice.logprobs.content)
    # The agent runs the tool itself and sends the call back as it got it, with the result.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="anything", messages=messages, tools=TOOLS, stream=True) if c.choices)
    assert text == "It is 42."
    assert engine.prompts[1][:len(engine.prompts[0])] == engine.prompts[0], "the second call continued the first"

    assert [m.id for m in client.models.list().data] == ["policy"]
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model="p", messages=messages, n=2)
    with pytest.raises(openai.BadRequestError, match="non-empty list"):
        client.chat.completions.create(model="p", messages=[])
    with pytest.raises(openai.NotFoundError, match="unknown session 'other'"):
        client.chat.completions.create(model="p", messages=messages, extra_headers={"X-Session-Id": "other"})
    assert post(base + "/v1/sessions/s/close", {"reward": "high"})[0] == 400
    status, closed = post(base + "/v1/sessions/s/close", {"reward": 1})
    assert (status, closed["trajectories"], closed["calls"]) == (200, 1, 2)
    with pytest.raises(openai.ConflictError, match="is closed"):
        client.chat.completions.create(model="p", messages=messages)
    assert post(base + "/v1/sessions/s/close", {})[0] == 409
    [traj] = writer.written
    assert traj.turns[0].text == "Let me add." + CALL, "the model's own text is what the trajectory keeps"
    assert [t.role for t in traj.turns] == ["action", "observation", "action"]

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
from tests.helpers.gateway import KeptWriter, StandInEngine, engine_tokens, post

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


def test_a_stream_carries_the_engines_tokens_as_they_come_and_holds_back_what_the_answer_cuts(serve):
    engine = StandInEngine(["It is 42.", "Let me add." + CALL, "one, two. three", "12 + 30 = 42"])
    writer = KeptWriter()
    base = serve(Gateway(engine, SessionBook(60, auto_open=True), writer, model="policy"))
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]

    chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True, user="s1"))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) >= 5 and "".join(texts) == "It is 42.", texts  # a chunk per decoded token, not one
    assert engine.streamed == len(engine_tokens("It is 42."))
    last = chunks[-1]
    assert last.choices[0].finish_reason == "stop"
    captured = last.model_extra["rlstream"]
    assert captured["token_ids"] == engine_tokens("It is 42.") and captured["logprobs"] == [-0.25] * 10

    # With tools: the content streams up to the call, which comes as tool_calls, never as content text.
    chunks = list(client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True, user="s2"))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert text == "Let me add." and [t.function.name for t in calls] == ["add"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # A stop string: nothing after it is streamed (its first characters were held back until it was whole).
    chunks = list(client.chat.completions.create(model="m", messages=messages, stop=[". th"], stream=True,
                                                 user="s3"))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one, two"

    # Completions stream their text the same way.
    parts = [c.choices[0].text for c in client.completions.create(model="m", prompt="12 + 30", stream=True,
                                                                   user="s4") if c.choices]
    assert "".join(parts) == "12 + 30 = 42" and len([p for p in parts if p]) >= 5

    # A refusal is an error answer, not a stream.
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        list(client.chat.completions.create(model="m", messages=messages, n=2, stream=True, user="s5"))
    for sid in ("s1", "s2", "s3", "s4"):
        assert post(base + f"/v1/sessions/{sid}/close", {})[0] == 200
    assert [t.turns[0].text for t in writer.written][:2] == ["It is 42.", "Let me add." + CALL]

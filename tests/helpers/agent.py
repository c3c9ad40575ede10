"""A small agent program of its own, as a user would write one: it knows only an OpenAI base URL (the gateway),
calls the chat API with the real ``openai`` client, runs its own calculator tool between calls, and sends the
result back as a tool message. Nothing in it knows about rlstream but the session header."""
from __future__ import annotations

from openai import OpenAI

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def calculator(step: int) -> str:
    """The agent's own tool (it never goes through the gateway)."""
    return str(12 + 30 + step)


def run_agent(base_url: str, session: str, steps: int = 3, seed: int = 0, stream_at: int = -1,
              max_tokens: int = 6, chunks: list | None = None) -> tuple[list[dict], list]:
    """Run the agent for ``steps`` model calls (call ``stream_at`` streamed, its chunks appended to ``chunks``);
    the final conversation and each non-streamed response."""
    client = OpenAI(base_url=base_url, api_key="unused", default_headers={"X-Session-Id": session}, max_retries=0,
                    timeout=60)
    messages: list[dict] = [{"role": "system", "content": "You are a calculator agent. Use the add tool."},
                            {"role": "user", "content": "What is 12 + 30?"}]
    responses = []
    for step in range(steps):
        args = dict(model="policy", messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=1.0,
                    seed=seed * 100 + step)
        if step == stream_at:
            streamed = list(client.chat.completions.create(stream=True, **args))
            if chunks is not None:
                chunks += streamed
            text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
            messages.append({"role": "assistant", "content": text})
        else:
            response = client.chat.completions.create(**args)
            responses.append(response)
            messages.append(response.choices[0].message.model_dump(exclude_none=True))
        if step < steps - 1:
            for call in messages[-1].get("tool_calls") or [{"id": f"own-{step}"}]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": calculator(step)})
    return messages, responses

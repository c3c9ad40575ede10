"""The OpenAI side of a call: prompts as token ids, kept across an episode's calls; the model's tool calls out.

An agent sends its whole conversation with every call. Re-tokenizing it would re-tokenize the model's own earlier
answers, which need not give the tokens the model sampled (BPE merges differently; multi-turn drift). So a call
whose messages extend the previous call's conversation, *including the assistant message the gateway returned*,
continues the episode's token sequence: the previous prompt and response tokens as the engine had them, then only
the ids of what the agent added (tool results, a new user message) and the generation prompt, rendered through the
policy's chat template as a text difference (``continuation``). A call that does not extend it (the agent edited
or cut its history) starts a new segment of the episode from the fully rendered prompt.

Completions (``/v1/completions``) chain alike on text: a prompt that starts with the previous prompt and response
continues with the ids of the rest.

Tool calls: the request's ``tools`` reach the template as given; a response with Hermes-style
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks is answered with OpenAI ``tool_calls`` (the
agent runs them, the gateway never does), the text outside the blocks as ``content``.
"""
from __future__ import annotations

import json
import re
import uuid

_SENTINEL = "\x00rlstream-gateway\x00"
#: Where a Hermes tool call starts in the model's text.
TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class ChatError(ValueError):
    """A request the gateway cannot serve; the message says why (answered with 400)."""


def _content(value) -> str:
    """A message's content as text: a string, the text parts of a list, or '' for none."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(p.get("text", "") for p in value if isinstance(p, dict) and p.get("type", "text") == "text")
    raise ChatError(f"message content must be a string or a list of text parts, not {type(value).__name__}")


def _arguments(raw) -> object:
    """Tool-call arguments compared by value: a JSON string and the object it holds are the same call."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def normalize(messages) -> list[dict]:
    """The messages as the template sees them and as they are compared: role, text content, and where present the
    tool calls (name and arguments as objects), the tool call id and the name; everything else dropped."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatError(f"messages[{i}] must be an object with a role")
        n = {"role": m["role"], "content": _content(m.get("content"))}
        if m.get("tool_calls"):
            n["tool_calls"] = [{"type": "function", "id": c.get("id", ""),
                                "function": {"name": c.get("function", {}).get("name", ""),
                                             "arguments": _arguments(c.get("function", {}).get("arguments"))}}
                               for c in m["tool_calls"] if isinstance(c, dict)]
        for key in ("tool_call_id", "name"):
            if m.get(key):
                n[key] = str(m[key])
        out.append(n)
    return out


def _same(a: dict, b: dict) -> bool:
    """Equal messages for chaining (tool call ids are the agent's to rename)."""
    strip = lambda m: {**m, "tool_calls": [{**c, "id": ""} for c in m.get("tool_calls", [])]}  # noqa: E731
    return strip(a) == strip(b)


def render(tok, messages: list[dict], tools: list | None, generation_prompt: bool) -> str:
    """The template's text of ``messages`` (normalized)."""
    if not getattr(tok, "chat_template", None):
        raise ChatError("the policy's tokenizer has no chat template: use /v1/completions, or give the trainer "
                        "--chat-template so every version carries one")
    kwargs = {"tools": tools} if tools else {}
    return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)


def ids(tok, text: str) -> list[int]:
    """Token ids of template text (its special tokens recognised, none added)."""
    return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]


def prompt_ids(tok, messages: list[dict], tools: list | None) -> tuple[str, list[int]]:
    """A fresh prompt: the conversation rendered with the generation prompt, and its ids."""
    text = render(tok, messages, tools, True)
    return text, ids(tok, text)


def continuation(tok, before: list[dict], ended_with_eos: bool, messages: list[dict],
                 tools: list | None) -> tuple[str, list[int]] | None:
    """The text and ids that follow an episode's tokens when ``messages`` extend ``before`` (the conversation so far,
    ending in the assistant message the gateway returned); None when they do not, or the template does not render
    the longer conversation as an extension of the shorter one.

    The assistant turn's closing (``<|im_end|>\\n`` in ChatML) is rendered by the template but only partly sampled:
    the model's end-of-turn token is in the episode already, the rest (the newline) is added here.
    """
    if len(messages) <= len(before) or not all(_same(a, b) for a, b in zip(before, messages)):
        return None
    shorter, longer = render(tok, before, tools, False), render(tok, messages, tools, True)
    if not longer.startswith(shorter):
        return None
    closing = _closing(tok, before[:-1], tools)
    eos = tok.eos_token or ""
    if ended_with_eos and eos and closing.startswith(eos):
        closing = closing[len(eos):]
    text = closing + longer[len(shorter):]
    return text, ids(tok, text)


def _closing(tok, before: list[dict], tools: list | None) -> str:
    """What the template writes after an assistant message's content."""
    text = render(tok, [*before, {"role": "assistant", "content": _SENTINEL}], tools, False)
    at = text.rfind(_SENTINEL)
    return "" if at < 0 else text[at + len(_SENTINEL):]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """The response text as an OpenAI message's ``content`` and ``tool_calls``: Hermes ``<tool_call>`` blocks whose
    body is a JSON ``{"name", "arguments"}`` become calls; a malformed block stays in the content, untouched (the
    agent sees what the model wrote)."""
    calls, kept, last = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        args = body.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": body["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
        kept.append(text[last:match.start()])
        last = match.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


def assistant_message(content: str | None, tool_calls: list[dict]) -> dict:
    """The assistant message as returned to the agent (and as the next call must repeat it to chain)."""
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message

"""The gateway's pure logic with a real tokenizer (byte-level BPE, ChatML): a later call's prompt continues the
engine's own tokens; tool calls out as OpenAI tool_calls; sessions refused with their reason; episodes as
trajectories whose turns tile their tokens."""
from __future__ import annotations

import json

import pytest

from rlstream.gateway import chat
from rlstream.gateway.reward import posted
from rlstream.gateway.service import Gateway, sampling
from rlstream.gateway.sessions import REWARD_KEY, SessionBook, SessionError
from rlstream.schemas.records import Failure
from tests.helpers.gateway import KeptWriter, StandInEngine, engine_tokens, stand_in_tokenizer

TOK = stand_in_tokenizer()
SYSTEM = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 12 + 30?"}]


def test_a_later_call_continues_the_engines_tokens_and_renders_only_what_the_agent_added():
    _, first = chat.prompt_ids(TOK, chat.normalize(SYSTEM), None)
    answer = engine_tokens("The answer is 42.")
    assert answer[:-1] != chat.ids(TOK, "The answer is 42."), "the point: re-tokenizing would give other ids"
    before = chat.normalize(SYSTEM + [{"role": "assistant", "content": "The answer is 42."}])
    later = before + [{"role": "tool", "content": "42", "tool_call_id": "c1"}, {"role": "user", "content": "ok?"}]
    text, added = chat.continuation(TOK, before, True, chat.normalize(later), None)
    assert text == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>user\nok?<|im_end|>\n<|im_start|>assistant\n"
    # The whole sequence is the conversation as the template renders it, yet the answer keeps the engine's ids.
    sequence = first + answer + added
    assert TOK.decode(sequence) == chat.render(TOK, chat.normalize(later), None, True)
    assert sequence[len(first):len(first) + len(answer)] == answer


def test_an_answer_cut_by_length_gets_its_whole_closing():
    before = chat.normalize(SYSTEM + [{"role": "assistant", "content": "The ans"}])
    text, _ = chat.continuation(TOK, before, False, before + [{"role": "user", "content": "go on"}], None)
    assert text.startswith("<|im_end|>\n<|im_start|>user\ngo on")


@pytest.mark.parametrize("later", [
    SYSTEM + [{"role": "assistant", "content": "edited by the agent"}, {"role": "user", "content": "x"}],
    SYSTEM[:1] + [{"role": "user", "content": "history cut"}],
    SYSTEM + [{"role": "assistant", "content": "42"}],  # nothing added: a retry of the same call
])
def test_a_call_that_does_not_extend_the_conversation_starts_afresh(later):
    before = chat.normalize(SYSTEM + [{"role": "assistant", "content": "42"}])
    assert chat.continuation(TOK, before, True, chat.normalize(later), None) is None


def test_tool_calls_become_openai_tool_calls_and_a_malformed_one_stays_text():
    text = 'Let me add.<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
    content, calls = chat.parse_tool_calls(text)
    assert content == "Let me add." and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 12, "b": 30}
    # Echoed back by the agent (a new id, arguments as a string): the same message for chaining.
    returned = chat.normalize([chat.assistant_message(content, calls)])
    echoed = chat.normalize([{"role": "assistant", "content": "Let me add.", "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "add", "arguments": '{"b": 30, "a": 12}'}}]}])
    assert chat._same(returned[0], echoed[0])
    broken = "<tool_call>{not json}</tool_call>"
    assert chat.parse_tool_calls(broken) == (broken, [])


def test_sessions_refuse_unknown_closed_and_duplicate_ids_and_time_out():
    now = [0.0]
    book = SessionBook(timeout_s=10, clock=lambda: now[0])
    with pytest.raises(SessionError) as unknown:
        book.get("nope")
    assert unknown.value.status == 404 and "POST /v1/sessions" in str(unknown.value)
    with pytest.raises(SessionError) as missing:
        book.get(None)
    assert missing.value.status == 400 and "X-Session-Id" in str(missing.value)
    s = book.open({"session_id": "a", "group_id": "g", "group_size": 4})
    with pytest.raises(SessionError) as dup:
        book.open({"session_id": "a"})
    assert dup.value.status == 409
    with pytest.raises(SessionError) as bad:
        book.open({"group_size": "many"})
    assert bad.value.status == 400
    assert book.get("a") is s and (s.group_id, s.group_size) == ("g", 4)
    book.close("a")
    with pytest.raises(SessionError) as closed:
        book.get("a")
    assert closed.value.status == 409 and "closed" in str(closed.value)
    book.open({"session_id": "b"})
    now[0] = 5
    book.get("b")  # a call keeps it alive
    now[0] = 14
    assert book.expired() == []
    now[0] = 16
    assert [x.session_id for x in book.expired()] == ["b"] and len(book) == 0
    auto = SessionBook(timeout_s=10, auto_open=True)
    assert auto.get("new").group_id == "new"


def test_an_episode_of_calls_becomes_one_trajectory_whose_turns_tile_the_engines_tokens():
    engine = StandInEngine(["Let me add.", "It is 42.", "Other."])
    writer = KeptWriter()
    gw = Gateway(engine, SessionBook(60), writer)
    gw.open({"session_id": "s1", "group_id": "g1", "answer": "42"})
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = list(SYSTEM)
    first = gw.chat("s1", {"messages": messages, "tools": tools, "max_tokens": 20})
    messages.append(first["choices"][0]["message"])
    messages.append({"role": "tool", "tool_call_id": "c", "content": "42"})
    second = gw.chat("s1", {"messages": messages, "tools": tools})
    assert second["rlstream"]["chained"] and second["rlstream"]["policy_version"] == 3
    assert engine.prompts[1][:len(engine.prompts[0])] == engine.prompts[0], "the second prompt extends the first"
    assert gw.close("s1", {"reward": 0.75}) == {"session_id": "s1", "trajectories": 1, "calls": 2}
    [traj] = writer.written
    assert [t.role for t in traj.turns] == ["action", "observation", "action"]
    assert traj.turns[0].text == "Let me add." and traj.turns[1].text.startswith("\n<|im_start|>tool\n42")
    assert traj.token_ids[:traj.turns[0].token_end] == engine_tokens("Let me add.")
    assert traj.loss_mask == [int(t.role == "action") for t in traj.turns
                              for _ in range(t.token_start, t.token_end)]
    assert traj.task.prompt_token_ids + traj.token_ids == engine.prompts[1] + engine_tokens("It is 42.")
    assert (traj.min_policy_version, traj.group_id, traj.task.answer, traj.status) == (3, "g1", "42", "ok")
    assert posted(traj) == 0.75 and traj.task.metadata[REWARD_KEY] == "0.75"
    with pytest.raises(SessionError) as closed:
        gw.chat("s1", {"messages": messages})
    assert closed.value.status == 409


def test_a_rewritten_history_starts_a_second_segment_and_an_unclosed_session_fails_as_timed_out():
    engine = StandInEngine(["One.", "Two."])
    writer = KeptWriter()
    gw = Gateway(engine, SessionBook(0.05), writer)
    gw.open({"session_id": "s2"})
    gw.chat("s2", {"messages": SYSTEM})
    again = gw.chat("s2", {"messages": SYSTEM[:1] + [{"role": "user", "content": "start over"}]})
    assert not again["rlstream"]["chained"] and again["rlstream"]["segment"] == 1
    import time
    time.sleep(0.1)
    assert gw.expire() == 1
    assert [t.trajectory_id for t in writer.written] == ["s2:0", "s2:1"]
    assert {t.status for t in writer.written} == {"failed"}
    assert writer.written[0].failure == Failure("gateway_timeout", "no call and no close for 0.05s", "gateway")
    with pytest.raises(ValueError, match="no reward was posted"):
        posted(writer.written[0])


def test_sampling_refuses_what_it_cannot_honour():
    with pytest.raises(SessionError, match="n must be 1"):
        sampling({"n": 2}, 16)
    with pytest.raises(SessionError, match="bad sampling"):
        sampling({"temperature": "hot"}, 16)
    assert sampling({"max_completion_tokens": 9, "stop": "x"}, 16).max_tokens == 9


def test_a_stop_string_ends_the_answer_and_the_tokens_after_it_are_dropped():
    from rlstream.gateway.service import cut_at_stop
    from rlstream.engine import Generation
    ids = engine_tokens("It is 42. Then more", eos=False)
    gen = Generation(list(ids), [-1.0] * len(ids), "length", versions=[0] * len(ids))
    assert cut_at_stop(TOK, gen, ["nothing", ". T"]) == "It is 42"
    # The tokens up to the one that completed the stop string were sampled, and stay; the rest go.
    assert gen.token_ids == ids[:len("It is 42. T")] and len(gen.logprobs) == len(gen.versions) == len(gen.token_ids)
    assert gen.finish_reason == "stop"
    same = Generation(list(ids), [-1.0] * len(ids), "length", versions=[0] * len(ids))
    assert cut_at_stop(TOK, same, []) == "It is 42. Then more" and same.token_ids == ids

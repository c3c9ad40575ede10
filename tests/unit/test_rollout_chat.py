"""The rollout stage on chat tasks: the template's prompt, each later turn through the template, the engine's tokens
kept as they were sampled, and the episode that runs out of context. The engine is a scripted fake (this is a test
of the stage's bookkeeping, not of an engine); the tokenizer is a real trained BPE with a ChatML template."""
from __future__ import annotations

import json

from rlstream.runtime.stage import Incoming, InvalidRecord
from rlstream.schemas.records import SamplingParams, Task, Turn
from rlstream.engine import Generation
from rlstream.stages.rollout import RolloutSettings, RolloutStage
from tests.helpers.engines import FakeBackend, FakeWatcher, pv
from tests.helpers.models import chat_tokenizer


class ScriptedBackend(FakeBackend):
    """Answers each call with the next scripted text's token ids, then the end-of-turn token."""

    def __init__(self, tok, answers: list[str]):
        super().__init__(mid_generation=False)
        self.tok, self.answers, self.seen = tok, list(answers), []

    def generate(self, prompts, params, between_steps=None, keys=None):
        self.seen.append((prompts, params.max_tokens))
        ids = self.tok(self.answers.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [Generation(ids, [-0.5] * len(ids), "stop", [0] * len(ids)) for _ in prompts]


def chat_stage(answers: list[str], max_context: int = 512) -> tuple[RolloutStage, object]:
    tok = chat_tokenizer()
    stage = RolloutStage(RolloutSettings(swap="batch", max_context=max_context))
    stage.follower.watcher = FakeWatcher(pv(0))
    stage.backend, stage.tokenizer, stage.follower.version = ScriptedBackend(tok, answers), tok, 0
    return stage, tok


def chat_task(messages: list[dict], max_tokens: int = 16) -> Task:
    return Task(task_id="t", group_id="t", task_name="chat", env_name="e", env_version="1", prompt="-",
                sampling=SamplingParams(max_tokens=max_tokens), created_at=0, group_size=1, max_turns=3,
                metadata={"messages": json.dumps(messages)})


def test_each_turn_goes_through_the_template_and_the_engine_tokens_are_kept():
    stage, tok = chat_stage(["40 + 2", "42"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 40 + 2?"}]
    [[out]] = stage.handle_batch([Incoming("prompts", 0, 0, None, {}, -1, chat_task(messages))])
    ep = out.record
    assert tok.decode(ep.task.prompt_token_ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                                    "What is 40 + 2?<|im_end|>\n<|im_start|>assistant\n")
    first = tok("40 + 2", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ep.token_ids == first and ep.loss_mask == [1] * len(first)
    # The env answers; the next turn is the template's user turn and generation prompt, never trained on.
    ep.turns.append(Turn("observation", "Show only the number.", len(ep.token_ids), len(ep.token_ids)))
    [[out]] = stage.handle_batch([Incoming("observations", 0, 1, None, {}, 0, ep)])
    ep = out.record
    obs = ep.turns[1]
    assert tok.decode(ep.token_ids[obs.token_start:obs.token_end]) == \
        "<|im_start|>user\nShow only the number.<|im_end|>\n<|im_start|>assistant\n"
    second = tok("42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ep.token_ids[obs.token_end:] == second
    assert ep.loss_mask == [1] * len(first) + [0] * (obs.token_end - obs.token_start) + [1] * len(second)
    # What the engine was given for turn 2: everything so far, exactly.
    assert stage.backend.seen[1][0] == [ep.task.prompt_token_ids + ep.token_ids[:obs.token_end]]
    assert json.loads(ep.task.metadata["messages"]) == messages  # the original conversation, unchanged


def test_new_tokens_are_cut_to_the_context_left_and_a_prompt_that_does_not_fit_is_refused():
    stage, tok = chat_stage(["1"], max_context=40)
    task = chat_task([{"role": "user", "content": "Hi"}], max_tokens=500)
    stage.settings = RolloutSettings(swap="batch", max_context=40, max_new_tokens=100)
    [[out]] = stage.handle_batch([Incoming("prompts", 0, 0, None, {}, -1, task)])
    assert stage.backend.seen[0][1] == 40 - len(out.record.task.prompt_token_ids)
    long = chat_task([{"role": "user", "content": "word " * 60}])
    [refused] = stage.handle_batch([Incoming("prompts", 0, 1, None, {}, -1, long)])
    assert isinstance(refused, InvalidRecord)
    assert f"prompt of {len(long.prompt_token_ids)} tokens does not fit max_context 40" in str(refused)


def test_a_chat_task_on_a_model_without_a_template_is_refused_with_how_to_fix_it():
    stage, _ = chat_stage(["x"])
    stage.tokenizer = chat_tokenizer(chat_template=None)
    [refused] = stage.handle_batch([Incoming("prompts", 0, 0, None, {}, -1, chat_task([{"role": "user",
                                                                                         "content": "Hi"}]))])
    assert isinstance(refused, InvalidRecord) and "--chat-template FILE" in str(refused)

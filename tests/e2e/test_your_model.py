"""The user's own model and data round the loop: a ``save_pretrained`` folder of another architecture than the
demo's, a JSONL dataset through ``rlstream prompts --dataset --chat``, the model's chat template, and a response
of 1,024 tokens. Every stage is real: the broker, the trainer, env, reward and rollout (transformers in process,
to read its weights; vLLM in its own process for the long response)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from rlstream.config import KafkaSettings, LoopSettings
from rlstream.runtime.runner import StageRunner
from rlstream.runtime.settings import RuntimeSettings
from rlstream.stages.rollout import RolloutSettings, RolloutStage
from tests.helpers import ROOT
from tests.helpers.kafka import read_all, wait_for
from tests.helpers.models import llama_folder

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

SYSTEM = "Answer with the number."


def digest(state: dict[str, torch.Tensor]) -> str:
    """One hash of a set of named tensors: names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def folder_digest(folder) -> str:
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    return digest(state)


def write_dataset(path, n: int) -> None:
    rows = [{"question": f"What is {a} + {a + 1}?", "answer": f"{a} + {a + 1} = {2 * a + 1}\n#### {2 * a + 1}"}
            for a in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def prompts(bootstrap: str, run: str, dataset, *args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "rlstream.cli", "prompts", "--bootstrap", bootstrap, "--run", run,
                          "--dataset", str(dataset), "--prompt-column", "question", "--chat", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.timeout(600)
def test_a_save_pretrained_folder_goes_round_the_loop(bootstrap, run_name, tmp_path, start_stage):
    """Trainer -> weight store -> rollout -> trainer on a Llama folder: version 0 is the folder as given, and the
    rollout's weights hash-equal each published version's; prompts went through the chat template."""
    folder = llama_folder(tmp_path / "my-llama", max_positions=256)
    weights = tmp_path / "weights"
    write_dataset(tmp_path / "train.jsonl", 8)
    prompts(bootstrap, run_name, tmp_path / "train.jsonl", "--system-prompt", SYSTEM, "--max-tokens", "6",
            "--group-size", "2")
    loop = LoopSettings(run=run_name, group_size=2, groups_per_step=2)
    trainer = start_stage("trainer", bootstrap, run_name, "--model", str(folder), "--weights", str(weights),
                          "--max-steps", "3", "--window-groups", "4", "--groups-per-step", "2", "--group-size", "2",
                          "--lr", "1e-2")
    start_stage("env", bootstrap, run_name, "--sandbox", "subprocess")
    start_stage("reward", bootstrap, run_name, "--reward", "tests.reward_fns:token_checksum")
    stage = RolloutStage(RolloutSettings(backend="transformers", swap="step"), loop)
    runner = StageRunner(stage, KafkaSettings(bootstrap=bootstrap, run=run_name), RuntimeSettings(batch_size=8))
    thread = threading.Thread(target=runner.run, name="rollout", daemon=True)
    thread.start()
    try:
        wait_for(lambda: stage.version >= 1, 300, "the rollout to load version 1")
        # Version 0 is the folder as given, bit for bit; each later one is what the rollout generates with.
        assert folder_digest(weights / "policy" / "v0") == folder_digest(folder)
        loaded = stage.version
        with stage._engine_lock:  # no swap while we read
            assert digest(stage.backend.model.state_dict()) == folder_digest(weights / "policy" / f"v{stage.version}")
        assert loaded >= 1 and folder_digest(weights / "policy" / "v1") != folder_digest(folder), "v1 did not train"
        assert trainer.wait(240) == 0, trainer.log_tail(3000)
    finally:
        runner.request_stop()
        thread.join(60)
    rewards = read_all(bootstrap, run_name, "rewards", expect=12, timeout=60)
    versions = [s.record for s in read_all(bootstrap, run_name, "policy-versions", expect=4)]
    assert [v.version for v in versions] == [0, 1, 2, 3]

    tok = stage.tokenizer
    for seen in rewards:
        traj = seen.record.trajectory
        messages = json.loads(traj.task.metadata["messages"])  # kept as they were, for the archive and replay
        assert [m["role"] for m in messages] == ["system", "user"] and messages[0]["content"] == SYSTEM
        assert messages[1]["content"].startswith("What is ") and messages[1]["content"] in traj.task.prompt
        # The prompt ids are the chat template's, with the generation prompt; the response ids are the engine's.
        assert traj.task.prompt_token_ids == tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=True, return_dict=False)
        assert tok.decode(traj.task.prompt_token_ids).startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
        assert len(traj.token_ids) == len(traj.behaviour_logprobs) == len(traj.loss_mask) <= 6
        assert traj.turns[0].text == tok.decode(traj.token_ids, skip_special_tokens=True)


@pytest.mark.timeout(600)
def test_a_1024_token_response_through_the_whole_loop(bootstrap, run_name, tmp_path, start_stage):
    """vLLM generates 1,024 new tokens per sample (the model never ends a turn), env and reward pass them on, and
    the trainer trains a version on them."""
    folder = llama_folder(tmp_path / "long", max_positions=1280, never_stop=True)
    write_dataset(tmp_path / "train.jsonl", 1)
    prompts(bootstrap, run_name, tmp_path / "train.jsonl", "--max-tokens", "1024", "--group-size", "2")
    procs = [start_stage("trainer", bootstrap, run_name, "--model", str(folder), "--weights", str(tmp_path / "w"),
                         "--max-steps", "1", "--window-groups", "2", "--groups-per-step", "1", "--group-size", "2"),
             start_stage("rollout", bootstrap, run_name, "--backend", "vllm", "--max-context", "1280",
                         "--handler-timeout-s", "300"),
             start_stage("env", bootstrap, run_name, "--sandbox", "subprocess"),
             start_stage("reward", bootstrap, run_name, "--reward", "math")]
    assert procs[0].wait(480) == 0, "\n".join(p.log_tail(2000) for p in procs)
    rewards = read_all(bootstrap, run_name, "rewards", expect=2, timeout=30)
    assert len(rewards) == 2
    for seen in rewards:
        traj = seen.record.trajectory
        assert len(traj.token_ids) == len(traj.behaviour_logprobs) == sum(traj.loss_mask) == 1024
        assert traj.turns[0].finish_reason == "length" and all(lp <= 0 for lp in traj.behaviour_logprobs)
    [_, v1] = [s.record for s in read_all(bootstrap, run_name, "policy-versions", expect=2)]
    assert v1.version == 1 and v1.samples_trained == 2

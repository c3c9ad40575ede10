"""The bad-input corpus against real stage processes: every bad record ends in dead-letters or as a recorded
failure with a clear reason, good records keep flowing, and in = out + dead letters + failures.

Garbage, truncated, unknown-fingerprint, missing / non-integer policy_version, wrong-record records and
raising / hanging / NaN / inf / wrong-type rewards are in test_stage_runtime.py; this file has the rest.
"""
from __future__ import annotations

import collections
import copy
import random
import string
import time

import pytest
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from rlstream.infra.supervisor import StageProc
from rlstream.kafka.topics import topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.schemas.records import Episode, PolicyVersion, Reward, SamplingParams, ScoredTrajectory, Task, Turn
from tests.helpers.kafka import make_task, make_trajectory, produce, read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

LIMIT = 100_000  # max.message.bytes of the topics the oversized test shrinks, and the stage's --max-record-bytes


def _limit_topics(bootstrap: str, run: str, logicals: list[str], limit: int) -> None:
    """Shrink the topics' max.message.bytes, so records at the limit are cheap to make."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    entry = [ConfigEntry("max.message.bytes", str(limit), incremental_operation=AlterConfigOpType.SET)]
    resources = [ConfigResource("topic", topic_name(run, t), incremental_configs=entry) for t in logicals]
    for future in admin.incremental_alter_configs(resources).values():
        future.result(30)
    deadline = time.monotonic() + 30
    for r in resources:  # the change is applied asynchronously
        while admin.describe_configs([ConfigResource("topic", r.name)])[ConfigResource("topic", r.name)].result(
                30)["max.message.bytes"].value != str(limit):
            assert time.monotonic() < deadline, f"{r.name} kept its old max.message.bytes"
            time.sleep(0.2)


def _scored_size(traj) -> int:
    """Bytes of the reward stage's output for ``traj`` (exact_match's reward, with its stage time)."""
    traj = copy.deepcopy(traj)
    traj.stage_times["reward.end"] = hdr.now_ms()
    reward = Reward(total=1.0, reward_version="v1", breakdown={"exact": 1.0}, verifier_version="exact_match/1",
                    latency_ms=0.5, scored_at=hdr.now_ms())
    return len(default_codec().encode("ScoredTrajectory", ScoredTrajectory(traj, reward).to_dict()))


def _incompressible(i: int, output_bytes: int):
    """A trajectory whose scored output is ``output_bytes`` long and does not compress (random text)."""
    traj = make_trajectory(i)
    rnd = random.Random(i)
    text = "".join(rnd.choice(string.ascii_letters + string.digits) for _ in range(output_bytes))
    traj.response = text[:output_bytes - _scored_size(traj)]
    traj.response = text[:len(traj.response) + output_bytes - _scored_size(traj)]  # its length's varint grew
    assert _scored_size(traj) == output_bytes
    return traj


def _assert_alive(proc: StageProc) -> None:
    """Bad input never stops a stage."""
    assert proc.alive(), f"the stage died:\n{proc.log_tail()}"


@pytest.mark.timeout(540)
def test_oversized_outputs_are_dead_lettered_and_never_block_the_partition(bootstrap, run_name, tmp_path,
                                                                            start_stage):
    """An output over the size limit, even one whose value alone is just under it, is dead-lettered as oversized."""
    _limit_topics(bootstrap, run_name, ["rewards", "dead-letters"], LIMIT)
    good = [make_trajectory(i) for i in range(3)]
    # Its value is under the limit, but with its key, headers and framing the broker refuses it: without a
    # check of the size on the wire the transaction would abort and be redone forever, blocking the partition.
    near = _incompressible(100, LIMIT - 30)
    big = _incompressible(101, 2 * LIMIT)
    fits = _incompressible(102, LIMIT // 2)
    # One key: one partition, in this order, so a stuck record would hold back every record after it.
    items = [good[0], near, good[1], big, fits, good[2]]
    produce(bootstrap, run_name, "trajectories", [(b"k", t, None) for t in items])
    log = tmp_path / "reward.log"
    proc = start_stage("reward", bootstrap, run_name, "--max-record-bytes", str(LIMIT), "--batch-size", "2",
                       "--instance", "r0", log_path=log)
    try:
        rewards = read_all(bootstrap, run_name, "rewards", expect=4, timeout=120)
        letters = read_all(bootstrap, run_name, "dead-letters", expect=2, timeout=60)
        _assert_alive(proc)
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert sorted(r.record.trajectory.trajectory_id for r in rewards) == sorted(
        t.trajectory_id for t in (*good, fits)), proc.log_tail()
    assert len(items) == len(rewards) + len(letters)  # in = out + dead letters
    originals = {r.offset: r for r in read_all(bootstrap, run_name, "trajectories", expect=len(items))}
    for letter in (l.record for l in letters):
        assert letter.reason == "oversized" and letter.stage == "reward", letter.error
        assert "exceeds 100000" in letter.error
        # The letter itself would not fit with the original bytes in it: it says where they are instead.
        assert letter.value is None and "not kept" in letter.error
        assert originals[letter.offset].record.trajectory_id in (near.trajectory_id, big.trajectory_id)


@pytest.mark.timeout(330)
def test_bad_headers_and_unencodable_outputs_are_dead_lettered(bootstrap, run_name, tmp_path, start_stage):
    """Null and non-UTF-8 headers, and a reward whose output cannot be encoded, never crash the stage."""
    good = [make_trajectory(i) for i in range(4)]
    bad = [
        (b"null-version", make_trajectory(100), [("policy_version", None)], "bad_header"),
        (b"binary-reward-version", make_trajectory(101), hdr.build(0, hdr.new_traceparent()) +
         [("reward_version", b"\xff\xfe")], "bad_header"),
        (b"surrogate", make_trajectory(102, response="surrogate"), None, "handler_error"),
    ]
    items = [(b"good", good[0], None)] + [(k, v, h) for k, v, h, _ in bad] + [(b"good", g, None) for g in good[1:]]
    produce(bootstrap, run_name, "trajectories", items)
    log = tmp_path / "reward.log"
    proc = start_stage("reward", bootstrap, run_name, "--reward", "tests.bad_envs:unencodable", "--batch-size", "3",
                       log_path=log)
    try:
        rewards = read_all(bootstrap, run_name, "rewards", expect=len(good), timeout=90)
        letters = read_all(bootstrap, run_name, "dead-letters", expect=len(bad), timeout=60)
        _assert_alive(proc)
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert sorted(r.record.trajectory.trajectory_id for r in rewards) == sorted(g.trajectory_id for g in good)
    assert {l.key: l.record.reason for l in letters} == {k: reason for k, _, _, reason in bad}
    by_key = {l.key: l.record for l in letters}
    assert by_key[b"null-version"].headers["policy_version"] == b""  # a null header value, kept as empty
    assert "does not fit its schema" in by_key[b"surrogate"].error
    assert len(items) == len(rewards) + len(letters)


# -- environments ----------------------------------------------------------------------------------------------


def _episode(i: int, env: str, action: str, max_turns: int = 4) -> Episode:
    """An episode as rollout writes it to ``actions``: one action turn of four tokens."""
    task = Task(task_id=f"task-{i}", group_id=f"group-{i}", task_name=env, env_name=env, env_version="1",
                prompt="p", sampling=SamplingParams(), created_at=hdr.now_ms(), answer="x",
                max_turns=max_turns if env != "single" else 1)
    return Episode(episode_id=f"group-{i}:0", group_id=task.group_id, sample_index=0, task=task,
                   token_ids=[1, 2, 3, 4], loss_mask=[1] * 4, behaviour_logprobs=[-1.0] * 4,
                   turns=[Turn("action", action, 0, 4, policy_version=0, finish_reason="stop")])


def _python(code: str) -> str:
    return f"```python\n{code}\n```"


@pytest.mark.timeout(450)
def test_environments_that_hang_or_crash_and_bad_text(bootstrap, run_name, tmp_path, start_stage):
    """Hanging, crashing and memory-hungry environments and tools end as failures or dead letters, with reasons."""
    codec = default_codec()
    ok = [_episode(i, "single", "cba") for i in range(3)]
    # (episode, what becomes of it): a failure class of a failed trajectory, or a dead-letter reason.
    failing = [
        (_episode(10, "python", _python("import time\ntime.sleep(60)")), ("failed", "timeout")),
        (_episode(11, "python", _python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")),
         ("failed", "crash")),
        (_episode(12, "python", _python("x = bytearray(1 << 30)")), ("failed", "memory")),
        (_episode(13, "raise", "anything"), ("failed", "env_error")),
        (_episode(14, "hang", "anything"), ("dead", "handler_timeout")),
        (_episode(15, "surrogate", "anything"), ("dead", "handler_error")),
    ]
    # A tool printing bytes that are not UTF-8 is not a failure: its observation carries U+FFFD instead.
    binary_tool = _episode(20, "python", _python("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe ok\\n')"))
    # Model text that is not UTF-8 inside the Avro body (a producer that is not Python): undecodable.
    raw = codec.encode("Episode", _episode(21, "single", "XXXX").to_dict())
    assert raw.count(b"XXXX") == 1
    invalid_text = raw.replace(b"XXXX", b"\xff\xfeXX")
    headers = lambda: hdr.build(0, hdr.new_traceparent())  # noqa: E731
    records = ([(ep.episode_id.encode(), ep, headers()) for ep in ok]
               + [(ep.episode_id.encode(), ep, headers()) for ep, _ in failing]
               + [(binary_tool.episode_id.encode(), binary_tool, headers()),
                  (b"invalid-utf8", invalid_text, headers()),
                  (b"binary-reward-version", _episode(22, "single", "cba"),
                   headers() + [("reward_version", b"\xff")]),
                  (b"null-version", _episode(23, "single", "cba"), [("policy_version", None)])])
    produce(bootstrap, run_name, "actions", records)
    dead_expected = {ep.episode_id.encode(): reason for ep, (kind, reason) in failing if kind == "dead"}
    dead_expected.update({b"invalid-utf8": "malformed", b"binary-reward-version": "bad_header",
                          b"null-version": "bad_header"})
    failed_expected = {ep.episode_id: cls for ep, (kind, cls) in failing if kind == "failed"}

    # The env stage with the misbehaving environments of tests/bad_envs.py registered.
    proc = start_stage("env", bootstrap, run_name, "--sandbox", "subprocess", "--tool-timeout-s", "2",
                       "--tool-memory-mb", "256", "--handler-timeout-s", "5", "--batch-size", "4",
                       module="tests.bad_envs")
    n_traj = len(ok) + len(failed_expected)
    try:
        trajectories = read_all(bootstrap, run_name, "trajectories", expect=n_traj, timeout=180)
        observations = read_all(bootstrap, run_name, "observations", expect=1, timeout=60)
        letters = read_all(bootstrap, run_name, "dead-letters", expect=len(dead_expected), timeout=60)
        _assert_alive(proc)
    finally:
        assert proc.stop(timeout=30) == 0, proc.log_tail()

    # in = out + dead letters + failures (failed trajectories are outputs that say why).
    failures = [t.record for t in trajectories if t.record.status == "failed"]
    assert len(records) == len(trajectories) + len(observations) + len(letters), proc.log_tail()
    assert {t.trajectory_id: t.failure.failure_class for t in failures} == failed_expected
    assert all(t.failure.stage == "env" and t.failure.message for t in failures)
    assert sorted(t.record.trajectory_id for t in trajectories if t.record.status == "ok") == sorted(
        ep.episode_id for ep in ok)
    assert {l.key: l.record.reason for l in letters} == dead_expected
    assert all(l.record.error and l.record.stage == "env" for l in letters)
    obs = observations[0].record
    assert obs.episode_id == binary_tool.episode_id and obs.turns[-1].text == "\ufffd\ufffd ok\n"


# -- rollout ---------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character that spells each byte in a byte-level BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_tokenizer():
    """The tiny character tokenizer plus one token per non-ASCII byte: most samples are not UTF-8."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from rlstream.models.tiny import BOS, CHARS, EOS, PAD, SPECIALS, UNK
    alphabet = _bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS + [alphabet[b] for b in range(0x80, 0x100)])}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("."), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                      special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                   padding_side="left", model_max_length=64, clean_up_tokenization_spaces=False)


def _publish_policy(bootstrap: str, run: str, root):
    """Version 0 of a random tiny policy over the byte tokenizer, as the trainer would announce it."""
    from rlstream.models.tiny import build_model
    from rlstream.policy.weights import WeightStore
    tokenizer = _byte_tokenizer()
    model = build_model(tokenizer, seed=0)

    def write(folder):
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    uri = WeightStore(str(root)).put("policy", 0, write)
    now = hdr.now_ms()
    produce(bootstrap, run, "policy-versions", [(b"policy", PolicyVersion(policy="policy", version=0, weights_uri=uri,
                                                                          created_at=now, published_at=now),
                                                 hdr.build(0, hdr.new_traceparent()))])
    return tokenizer


@pytest.mark.timeout(660)
def test_prompts_too_long_and_model_output_that_is_not_utf8(bootstrap, run_name, tmp_path, start_stage):
    """Rollout, env and reward processes: a too-long prompt is dead-lettered with its length, and non-UTF-8 model
    output keeps its exact token ids with U+FFFD in its text."""
    tokenizer = _publish_policy(bootstrap, run_name, tmp_path / "weights")
    g = 2
    short = [make_task(i, group_size=g) for i in range(4)]
    for i, t in enumerate(short):
        t.sampling = SamplingParams(temperature=1.0, max_tokens=4, seed=i)
    long = make_task(99, group_size=g, prompt="abc" * 30 + ">")  # 92 tokens; --max-context is 64
    long.sampling = SamplingParams(temperature=1.0, max_tokens=4)
    produce(bootstrap, run_name, "prompts", [(t.task_id.encode(), t, None) for t in (*short, long)])
    procs = {
        "rollout": start_stage("rollout", bootstrap, run_name, "--backend", "transformers", "--max-context", "64",
                               "--wait-policy-s", "120"),
        "env": start_stage("env", bootstrap, run_name, "--sandbox", "subprocess"),
        "reward": start_stage("reward", bootstrap, run_name),
    }
    n = len(short) * g
    try:
        rewards = read_all(bootstrap, run_name, "rewards", expect=n, timeout=240)
        letters = read_all(bootstrap, run_name, "dead-letters", expect=1, timeout=30)
        actions = read_all(bootstrap, run_name, "actions", expect=n, timeout=30)
        trajectories = read_all(bootstrap, run_name, "trajectories", expect=n, timeout=30)
        for p in procs.values():
            _assert_alive(p)
    finally:
        codes = {name: p.stop(timeout=30) for name, p in procs.items()}
    assert codes == {"rollout": 0, "env": 0, "reward": 0}, {n: p.log_tail(2000) for n, p in procs.items()}
    # Every short prompt became G episodes, every episode a trajectory, every trajectory a reward.
    assert len(actions) == len(trajectories) == len(rewards) == n
    assert collections.Counter(r.record.trajectory.trajectory_id for r in rewards).most_common(1)[0][1] == 1
    # The long one is one dead letter (the prompt record, not G episodes) that says how long it is against what.
    [letter] = [x.record for x in letters]
    assert (letter.stage, letter.reason, letter.key) == ("rollout", "invalid", long.task_id.encode())
    assert "prompt of 92 tokens does not fit max_context 64" in letter.error, letter.error
    assert not any(r.record.trajectory.task.task_id == long.task_id for r in rewards)

    # Model output that is not UTF-8: the token ids are the sample (they are trained on); the text is their
    # lossy view, with U+FFFD where bytes do not decode, for verifiers and people.
    alphabet = {c: b for b, c in _bytes_to_unicode().items()}
    not_utf8 = 0
    for r in rewards:
        traj = r.record.trajectory
        if traj.status != "ok":
            continue
        turn = traj.turns[-1]
        ids = traj.token_ids[turn.token_start:turn.token_end]
        tokens = [t for t in tokenizer.convert_ids_to_tokens(ids) if t not in tokenizer.all_special_tokens]
        raw = b"".join(bytes([alphabet[c]]) for t in tokens for c in t)
        assert turn.text == raw.decode("utf-8", "replace")
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            not_utf8 += 1
            assert "\ufffd" in turn.text
    assert not_utf8 > 0, "no sampled response was invalid UTF-8; the byte vocabulary should make most of them"


# -- trainer ---------------------------------------------------------------------------------------------------


@pytest.mark.timeout(390)
def test_trainer_skips_samples_whose_reward_version_header_is_null_or_binary(bootstrap, run_name, tmp_path):
    """The trainer told to train on one reward version meets null and non-UTF-8 reward_version headers: it
    neither crashes nor trains on them, and it trains on the good groups."""
    import threading

    from rlstream.config import KafkaSettings, LoopSettings
    from rlstream.runtime.settings import RuntimeSettings
    from rlstream.trainer.service import TrainerService, TrainerSettings

    g = 2

    def group(gid: int, reward_version) -> list[tuple]:
        out = []
        for i, r in enumerate((1.0, 0.0)):
            traj = make_trajectory(gid * 10 + i, group=gid, response="cba" if r else "abc")
            traj.task.group_size = g
            traj.task.prompt_token_ids = [1, 5, 6, 7, 40]
            headers = hdr.build(0, hdr.new_traceparent())
            headers.append(("reward_version", reward_version))
            out.append((traj.group_id.encode(), ScoredTrajectory(traj, Reward(total=r, reward_version="v1")), headers))
        return out
    # Bad headers first, in the same partition: a crash on them would hold back the good groups behind.
    produce(bootstrap, run_name, "rewards", group(1, None) + group(2, b"\xff\xfe") + group(3, b"v1") + group(4, b"v1"))
    trainer = TrainerService(TrainerSettings(weights=str(tmp_path / "weights"), warmup_steps=0, window_groups=4,
                                             reward_version="v1"), LoopSettings(groups_per_step=2))
    errors = []

    def serve():
        try:
            trainer.serve(KafkaSettings(bootstrap=bootstrap, run=run_name), RuntimeSettings(poll_timeout_s=0.1))
        except BaseException as exc:  # reported below
            errors.append(exc)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 180
    while trainer.version < 1 and not errors:
        assert time.monotonic() < deadline, f"trainer stuck at v{trainer.version}"
        time.sleep(0.2)
    trainer.stop()
    thread.join(60)
    assert errors == [] and trainer.version == 1
    versions = [r.record for r in read_all(bootstrap, run_name, "policy-versions", expect=2)]
    assert versions[-1].version == 1 and versions[-1].samples_trained == 2 * g  # groups 3 and 4 only

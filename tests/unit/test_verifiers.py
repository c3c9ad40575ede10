"""Built-in verifiers, composite reward specs, and the reward stage's judge-failure path (no Kafka).

The math cases are the kinds math-verify documents: fractions and decimals, LaTeX, boxed answers, units, sets and
percentages; the limits it has (units are stripped, not converted) are pinned too.
"""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from rlstream.rewards import (JUDGE_FAILURES, RewardResult, extract_answer, load_reward, normalise_loose, parse_spec,
                              regex_reward, verifiers)
from rlstream.runtime.stage import Incoming, InvalidRecord
from rlstream.sandbox import Sandbox, SandboxLimits
from rlstream.schemas.records import Failure, Trajectory
from rlstream.stages.reward import RewardSettings, RewardStage
from tests.helpers.episodes import traj

HERE = "tests.unit.test_verifiers"


def score(name: str, t: Trajectory) -> RewardResult:
    return verifiers.VERIFIERS[name](t)


# -- math ---------------------------------------------------------------------------------------------------------

EQUIVALENT = [
    # fractions and decimals, either way round
    ("1/2", "0.5"),
    ("0.5", r"so it is $\frac{1}{2}$"),
    (r"\frac{1}{2}", r"The answer is \boxed{\dfrac{2}{4}}"),
    ("0.75", "3/4 of the cake"),
    # LaTeX: the same value or expression written differently
    (r"$x^2+2x+1$", r"\boxed{(x+1)^2}"),
    ("x^2+2x+1", r"so $(x+1)^2$"),  # a bare gold answer is read as LaTeX
    (r"\frac{\sqrt{2}}{2}", r"\boxed{\frac{1}{\sqrt{2}}}"),
    (r"\{1, 2\}", r"\boxed{\{2, 1\}}"),
    # boxed answers: the last box counts, nested braces included
    ("5", r"first \boxed{3}, no wait: \boxed{5}"),
    ("2", r"\boxed{\frac{4}{2}}"),
    # units are stripped from the answer
    ("5", r"\boxed{5 \text{ cm}}"),
    ("5", r"\boxed{5\ \mathrm{cm}}"),
    ("5 cm", r"\boxed{5}"),
    ("5", "it is 5 cm long"),
    # percentages
    ("10", r"\boxed{10\%}"),
    # GSM8K's final line, thousands separators, and the last number
    ("72", "48 + 24 = 72 apples\n#### 72"),
    ("1000", "#### 1,000"),
    ("-7", "so the temperature fell to -7"),
    # a gold answer written as a worked solution is compared by its final answer
    ("3 + 15 = 18\n#### 18", r"\boxed{18}"),
]

DIFFERENT = [
    ("5", r"\boxed{3}"),
    ("5", r"first \boxed{5}, no wait: \boxed{3}"),  # the last box counts, not any box
    ("0.5", "1/3"),
    ("72", "#### 71"),
    ("5 km", r"\boxed{5000 \text{ m}}"),  # units are stripped, not converted: 5 km is not 5000 m here
    ("-7", "7"),
    (r"\{1, 2\}", r"\boxed{2}"),  # a set is not its last element
]


@pytest.mark.parametrize("answer, response", EQUIVALENT)
def test_math_equivalent_answers_score_one(answer, response):
    result = score("math", traj(response, answer))
    assert (result.total, result.breakdown, result.violations) == (1.0, {"math": 1.0}, [])
    assert result.verifier_version == "math/1"


@pytest.mark.parametrize("answer, response", DIFFERENT)
def test_math_different_answers_score_zero(answer, response):
    assert score("math", traj(response, answer)).total == 0.0


@pytest.mark.parametrize("text, expected", [
    (r"a \boxed{1} b \boxed{\frac{1}{2}} c", r"\boxed{\frac{1}{2}}"),
    (r"\boxed{2} then \boxed{3", r"\boxed{2}"),  # an unclosed last box: the one before it
    ("x\n#### 1,234\n", "1,234"),
    ("between 3 and 4.5 metres", "4.5"),
    ("no digits here", None),
    (r"\boxed{ }", None),
])
def test_final_answer_extraction(text, expected):
    assert extract_answer(text) == expected


def test_math_without_an_answer_says_why():
    result = score("math", traj("I do not know", "5"))
    assert (result.total, result.violations) == (0.0, ["no_answer"])


def test_math_needs_a_gold_answer():
    with pytest.raises(InvalidRecord, match="task.answer"):
        score("math", traj(r"\boxed{5}", None))


# -- exact, normalized, regex, format, length -----------------------------------------------------------------------


def test_exact_and_normalized_match():
    assert score("exact", traj("Paris<eos>", "Paris")).total == 1.0
    assert score("exact", traj("paris.", "Paris")).total == 0.0
    assert score("normalized", traj("paris.", "Paris")).breakdown == {"normalized": 1.0}


@pytest.mark.parametrize("a, b, same", [
    ("  The   Answer  ", "the answer", True),
    ("\u201cHello, world!\u201d", "hello world", True),
    ("ＡＢＣ", "abc", True),  # NFKC: full-width letters
    ("3.5", "35", False),  # a point inside a number stays
    ("-5", "5", False),  # a sign stays
    ("(-5).", "-5", True),
    ("don't", "dont", False),
])
def test_normalise_loose(a, b, same):
    assert (normalise_loose(a) == normalise_loose(b)) is same


def test_regex_from_the_task_and_fixed():
    date = {"regex": r"^\d{4}-\d{2}-\d{2}$"}
    assert score("regex", traj("2024-01-31", metadata=date)).breakdown == {"regex": 1.0}
    assert score("regex", traj("on 2024-01-31", metadata=date)).total == 0.0
    with pytest.raises(InvalidRecord, match="regex"):
        score("regex", traj("x"))
    with pytest.raises(InvalidRecord, match="does not compile"):
        score("regex", traj("x", metadata={"regex": "("}))
    has_yes = regex_reward(r"\byes\b", key="yes")
    assert has_yes(traj("well, yes")).breakdown == {"yes": 1.0}
    assert has_yes(traj("yesterday")).total == 0.0


@pytest.mark.parametrize("fmt, response, ok", [
    (None, r"so \boxed{42}", True),
    (None, "so 42", False),
    (None, r"\boxed{}", False),
    ("gsm8k", "work\n#### 42", True),
    ("gsm8k", "#### ", False),
    ("answer_tag", "<think>hm</think><answer> 42 </answer>", True),
    ("answer_tag", "<answer></answer>", False),
    ("code", "```python\nprint(1)\n```", True),
    ("code", "print(1)", False),
])
def test_format(fmt, response, ok):
    result = score("format", traj(response, metadata={"format": fmt} if fmt else None))
    assert result.breakdown == {"format": float(ok)} and result.verifier_version == "format/1"


def test_unknown_format_is_invalid():
    with pytest.raises(InvalidRecord, match="unknown"):
        score("format", traj("x", metadata={"format": "haiku"}))


@pytest.mark.parametrize("n_tokens, budget, penalty", [
    (10, None, 0.0), (48, None, 0.0), (56, None, -0.5), (64, None, -1.0), (90, None, -1.0),  # budget 48 of 64
    (37, "10", -0.5),  # a budget of 10 reaches -1 at max_tokens (64)
    (150, "100", -0.5),  # a budget past max_tokens reaches -1 at twice the budget
])
def test_length_penalty_is_linear_past_the_budget(n_tokens, budget, penalty):
    t = traj("x", metadata={"length_budget": budget} if budget else None, n_tokens=n_tokens, max_tokens=64)
    result = score("length", t)
    assert result.total == pytest.approx(penalty) and result.breakdown == {"length": result.total}


def test_length_counts_only_generated_tokens():
    t = traj("x", n_tokens=64)
    t.loss_mask = [1] * 40 + [0] * 24  # 24 tokens of tool observations: not the model's
    assert score("length", t).total == 0.0


# -- code -----------------------------------------------------------------------------------------------------------


@pytest.fixture
def small_sandbox(monkeypatch):
    """The code verifier's sandbox with a short timeout, so the hanging case is quick."""
    monkeypatch.setattr(verifiers, "_sandbox", Sandbox(SandboxLimits(timeout_s=3.0, cpu_s=3.0), backend="subprocess"))


TESTS = json.dumps(["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"])


def _code(body: str) -> str:
    return f"Here you go:\n```python\n{body}\n```\n"


@pytest.mark.parametrize("body, expected", [
    ("def add(a, b):\n    return a + b", 2 / 3),
    ("def add(a, b):\n    return 0", 1 / 3),
    ("def add(a, b) return a + b", 0.0),  # a syntax error
    ("import os\nos._exit(0)", 0.0),  # exiting early with success passes nothing
    ("import sys\nprint('pass 0 pass')\nsys.exit(0)", 0.0),
    ("def add(a, b):\n    print('x' * 100000)\n    return a + b", 2 / 3),  # output noise does not hide verdicts
])
def test_code_pass_rate(small_sandbox, body, expected):
    result = score("code", traj(_code(body), metadata={"tests": TESTS}))
    assert result.total == pytest.approx(expected) and result.verifier_version == "code/1"
    assert result.violations == []


def test_code_last_block_counts_and_one_snippet_is_one_test(small_sandbox):
    response = _code("def add(a, b):\n    return 0") + "fixed:\n" + _code("def add(a, b):\n    return a + b")
    assert score("code", traj(response, metadata={"tests": "assert add(2, 3) == 5"})).total == 1.0


def test_code_sandbox_failure_is_a_violation(small_sandbox):
    body = "def add(a, b):\n    return a + b\nimport time\ntime.sleep(60)"
    result = score("code", traj(_code(body), metadata={"tests": TESTS}))
    assert (result.total, result.violations) == (0.0, ["timeout"])


def test_code_without_code_or_tests():
    assert score("code", traj("no code", metadata={"tests": TESTS})).violations == ["no_code"]
    with pytest.raises(InvalidRecord, match="tests"):
        score("code", traj(_code("pass")))
    with pytest.raises(InvalidRecord, match="JSON list"):
        score("code", traj(_code("pass"), metadata={"tests": "[1, 2]"}))


# -- composite specs ------------------------------------------------------------------------------------------------


def shout(trajectory):
    """A user's reward returning a plain number (loaded by dotted path)."""
    return 1.0 if trajectory.response.isupper() else 0.0


async def async_shout(trajectory):
    """The same, as an async judge."""
    await asyncio.sleep(0)
    return {"loud": shout(trajectory)}


def crash(trajectory):
    raise RuntimeError("judge crashed")


def sleepy(trajectory):
    """A sync judge slower than the stage's judge timeout in the tests (short: the test waits for its thread)."""
    time.sleep(1.0)
    return 1.0


async def async_sleepy(trajectory):
    await asyncio.sleep(30)
    return 1.0


@pytest.mark.parametrize("spec, parts", [
    ("math", [("math", None)]),
    ("math:1.0,format:0.2, length:0.1", [("math", 1.0), ("format", 0.2), ("length", 0.1)]),
    ("pkg.mod:fn", [("pkg.mod:fn", None)]),
    ("pkg.mod:fn:-0.5,pkg.mod.other:2", [("pkg.mod:fn", -0.5), ("pkg.mod.other", 2.0)]),
    ("pkg.mod:inf", [("pkg.mod:inf", None)]),  # a function named inf, not a weight
])
def test_parse_spec(spec, parts):
    assert parse_spec(spec) == parts


def test_one_part_without_a_weight_is_the_function_itself():
    assert load_reward("math") is verifiers.math_answer
    assert load_reward(f"{HERE}:shout") is shout
    assert load_reward("rlstream.rewards:exact_match") is verifiers.VERIFIERS["exact"]


def test_composite_weights_each_part_into_the_breakdown():
    fn = load_reward("math:1.0,format:0.2,length:0.1")
    result = fn(traj(r"\boxed{5}", "5", n_tokens=56, max_tokens=64))
    assert result.breakdown == pytest.approx({"math": 1.0, "format": 0.2, "length": -0.05})
    assert result.total == pytest.approx(1.15) == sum(result.breakdown.values())
    assert result.verifier_version == "math/1*1+format/1*0.2+length/1*0.1"
    miss = fn(traj("no idea", "5"))
    assert miss.total == 0.0 and miss.violations == ["math:no_answer"]


def test_composite_with_a_dotted_path_and_an_async_part():
    fn = load_reward(f"exact,{HERE}:shout:0.5")
    assert fn(traj("5")).breakdown == {"exact": 1.0, "shout": 0.0}
    afn = load_reward(f"exact:2,{HERE}:async_shout")
    assert asyncio.iscoroutinefunction(afn)
    result = asyncio.run(afn(traj("YES", "YES")))
    assert result.breakdown == {"exact": 2.0, "async_shout": 1.0} and result.total == 3.0


@pytest.mark.parametrize("spec, message", [
    ("mth:1", "unknown reward 'mth'"),
    ("math:1,,format", "empty part"),
    ("math,math:2", "twice"),
    ("nosuch.module:fn", "cannot load"),
])
def test_bad_specs_fail_at_load(spec, message):
    with pytest.raises(ValueError, match=message):
        load_reward(spec)


# -- the reward stage: a judge that fails still scores the trajectory --------------------------------------------------


def handle(reward: str, t: Trajectory, timeout_s: float = 20.0):
    stage = RewardStage(RewardSettings(reward=reward, judge_timeout_s=timeout_s))
    [out] = asyncio.run(stage.handle(Incoming("trajectories", 0, 0, b"g", {}, 0, t)))
    assert out.topic == "rewards" and out.record.trajectory is t
    return out.record.reward


def test_a_judge_that_raises_gives_a_judge_error_reward():
    reward = handle(f"{HERE}:crash", traj("5"))
    assert (reward.failure_class, reward.total, reward.breakdown) == ("judge_error", 0.0, {})
    assert reward.violations == ["judge_error: RuntimeError: judge crashed"]
    assert reward.failure_class in JUDGE_FAILURES


@pytest.mark.parametrize("fn", ["sleepy", "async_sleepy"])
def test_a_judge_past_its_timeout_gives_a_judge_timeout_reward(fn):
    # The judges sleep 1 s and 30 s: only the timeout (0.3 s) gives judge_timeout.
    reward = handle(f"{HERE}:{fn}", traj("5"), timeout_s=0.3)
    assert (reward.failure_class, reward.total) == ("judge_timeout", 0.0)
    assert reward.violations == ["judge_timeout: no judgement within 0.3s"]


def test_an_unpipelined_batch_of_a_sync_judge_is_one_call_scored_as_each_record_alone_would_be():
    """RewardStage.handle_batch (--no-pipeline, replays): the same rewards as the per-record path, a judge past
    its timeout included; an async judge declines it (None) and keeps the per-record path."""
    def batch(reward: str, ts: list, timeout_s: float = 20.0):
        stage = RewardStage(RewardSettings(reward=reward, judge_timeout_s=timeout_s))
        return stage.handle_batch([Incoming("trajectories", 0, i, b"g", {}, 0, t) for i, t in enumerate(ts)])

    def essence(r):
        return r.total, r.failure_class, r.breakdown, r.violations
    ts = [traj("5"), traj("4"), traj("5", answer=None)]
    outs = batch("exact", ts)
    assert [type(o) for o in outs[:2]] == [list, list] and [o[0].record.trajectory for o in outs[:2]] == ts[:2]
    assert [essence(o[0].record.reward) for o in outs[:2]] == [essence(handle("exact", t)) for t in ts[:2]]
    assert type(outs[2]) is type(_raised(lambda: handle("exact", ts[2])))  # unjudgeable: dead-lettered alone
    [[crashed]] = batch(f"{HERE}:crash", [traj("5")])
    assert essence(crashed.record.reward) == essence(handle(f"{HERE}:crash", traj("5")))
    [[late]] = batch(f"{HERE}:sleepy", [traj("5")], timeout_s=0.3)
    assert essence(late.record.reward) == (0.0, "judge_timeout", {}, ["judge_timeout: no judgement within 0.3s"])
    assert batch(f"{HERE}:async_sleepy", [traj("5")]) is None


def _raised(fn):
    try:
        fn()
    except Exception as exc:
        return exc
    raise AssertionError("expected an exception")


def test_a_composite_part_raising_fails_the_whole_judgement():
    reward = handle(f"math,{HERE}:crash:0.1", traj(r"\boxed{5}"))
    assert reward.failure_class == "judge_error" and reward.breakdown == {}


def test_judged_and_unjudgeable_trajectories_are_unchanged():
    reward = handle("math:1,format:0.5", traj(r"\boxed{5}"))
    assert reward.failure_class is None and reward.total == 1.5 and reward.verifier_version == "math/1*1+format/1*0.5"
    failed = traj("5")
    failed.status, failed.failure = "failed", Failure("timeout", "tool ran too long", "env")
    assert handle(f"{HERE}:crash", failed).failure_class == "timeout"  # a failed episode is not judged at all
    with pytest.raises(InvalidRecord, match="task.answer"):
        handle("math", traj(r"\boxed{5}", None))  # cannot be judged: dead-lettered by the runtime

"""Reward functions: the one signature every reward takes, the built-in verifiers, and weighted composites.

A reward function has one signature::

    def reward(trajectory: Trajectory) -> float | dict[str, float] | RewardResult

It may be ``async`` (a remote judge). It reads the trajectory and never edits it: the reward stage writes the scored
trajectory over the bytes the trajectory arrived in (``rlstream.schemas.splice``), where an edit would not show,
and its token arrays are read-only views. A dict is a breakdown whose values sum to the total; a ``RewardResult``
also carries violations, the verifier's and judge's versions, and per-turn scores: ``turn_scores``, one float per
action turn of the trajectory (the turns whose role is ``action``, in order), beside the total::

    def judge(trajectory):
        calls = [t for t in trajectory.turns if t.role == "action"]
        return RewardResult(total=float(solved(trajectory)),
                            turn_scores=[0.1 if t.tool_result and t.tool_result.exit_code == 0 else 0.0
                                         for t in calls])

The trainer adds each turn's score to the advantage of that turn's tokens, under the rule stated in
``rlstream.trainer.advantages.turn_advantages``. Scores of another count than the action turns are the judge's
failure (``judge_error``, below). Raising ``InvalidRecord`` says the trajectory
cannot be judged (a task without an answer): it is dead-lettered with its reason. Raising anything else, or running
past the reward stage's ``--judge-timeout-s``, is the judge's failure: the trajectory is still scored, with a
Reward whose ``failure_class`` is ``judge_error`` or ``judge_timeout`` (``JUDGE_FAILURES``), total 0.0 and the
error in ``violations``; the trainer must not train on such a sample.

``--reward`` (``RLSTREAM_REWARD``) takes a spec: comma-separated parts, each a built-in verifier's name or a
dotted path (``package.module:function`` or ``package.module.function``), each with an optional ``:weight``::

    --reward math                                   # one built-in verifier
    --reward mypkg.rewards:judge                    # one function of yours, its return value as it is
    --reward "math:1.0,format:0.2,length:0.1"       # weighted sum of three verifiers
    --reward "math,mypkg.rewards:style:0.5"         # a part without a weight weighs 1.0

A composite's total is the weighted sum of its parts' totals, and its turn scores the weighted sum of the parts'
that give them; its breakdown has one key per part (the verifier's
name, or the function's name) holding that part's weighted share, so the breakdown sums to the total; violations
are prefixed ``part:``; its verifier version lists every part's version and weight (``math/1*1+format/1*0.2``).
A composite is ``async`` when any part is, and then its parts run concurrently. Any part raising fails the whole
judgement (``judge_error``): a total without one of its parts is not the reward that was asked for.

Built-in verifiers (``rlstream.rewards.verifiers`` documents what each reads from the task):
``math`` (math-verify answer equivalence: the last ``\\boxed{}``, ``#### x`` or last number against
``task.answer``), ``exact`` (``exact_match``), ``normalized`` (case, whitespace and punctuation aside), ``regex``
(``task.metadata["regex"]``; ``regex_reward(pattern)`` for a fixed one), ``format`` (``\\boxed{}``, ``#### x``,
``<answer>`` tags or a code block, by ``task.metadata["format"]``), ``length`` (a penalty in [-1, 0] past a token
budget), ``code`` (the share of ``task.metadata["tests"]`` the response's code passes in the sandbox) and
``calculator`` (``calculator_reward``: the right answer after a successful ``calc`` call), and
``calculator_turns`` (the same total, with turn scores: the successful call's turn and the right answer's).

A judge that calls a service (an LLM judge, a grader behind HTTP) is called again for the same trajectory after a
reward worker is killed or its transaction aborts: Kafka keeps one Reward, but the service sees the request twice.
``idempotency_key(trajectory)`` is the same for every such repeat; send it as the ``Idempotency-Key`` header (a
quoted string, as the IETF draft writes it) so the service can answer a repeat from its record
(docs/concepts/side-effects.md)::

    async def judge(trajectory):
        key = f'"{idempotency_key(trajectory)}"'
        async with session.post(URL, json=..., headers={"Idempotency-Key": key}) as r:
            return (await r.json())["score"]
"""
from rlstream.rewards.api import (JUDGE_FAILURES, NO_VERDICT, RewardResult, action_turn_count, as_result,
                                  check_turn_scores, final_text, idempotency_key, import_reward, judging)
from rlstream.rewards.builtin import calculator_reward, calculator_turns, exact_match, normalise_answer
from rlstream.rewards.compose import load_reward, parse_spec
from rlstream.rewards.verifiers import (FORMATS, VERIFIERS, code_tests, extract_answer, format_check, length_penalty,
                                        math_answer, normalise_loose, normalized_match, regex_match, regex_reward)

__all__ = ["FORMATS", "JUDGE_FAILURES", "NO_VERDICT", "VERIFIERS", "RewardResult", "action_turn_count", "as_result",
           "calculator_reward", "calculator_turns", "check_turn_scores", "code_tests",
           "exact_match", "extract_answer", "final_text", "format_check", "idempotency_key", "import_reward",
           "judging", "length_penalty",
           "load_reward", "math_answer", "normalise_answer", "normalise_loose", "normalized_match", "parse_spec",
           "regex_match", "regex_reward"]

"""Built-in verifiers: rule-based reward functions, each under a short name (``VERIFIERS``) for ``--reward``.

Each returns a RewardResult whose breakdown has one key, its name, and whose ``verifier_version`` is
``name/N`` (N changes whenever a verdict could change). What a verifier reads from the task:

- ``math``: ``task.answer``; the response's final answer is its last ``\\boxed{...}``, else a GSM8K ``#### x``
  line, else its last number or ``$...$`` span (whichever ends later), and equivalence is math-verify's
  (fractions and decimals, LaTeX, sets, percentages; units are stripped, not converted). math-verify's own
  signal-based timeouts do not work in the reward stage's threads, so they are off here: the stage's judge
  timeout bounds a slow comparison instead.
- ``exact`` (``rlstream.rewards:exact_match``): the response equals ``task.answer`` (surrounding whitespace and
  ``<eos>`` aside); ``normalized``: equal after case folding, Unicode NFKC, whitespace collapsed and punctuation at
  word edges dropped ("Paris." matches "paris"; "3.5" keeps its point, "-5" its sign).
- ``regex``: ``task.metadata["regex"]`` is found in the response (``re.search``; anchor it for a full match);
  ``regex_reward(pattern)`` makes one with a fixed pattern, to load by its dotted path.
- ``format``: the response has the shape ``task.metadata["format"]`` names (default ``boxed``): ``boxed``
  (a non-empty ``\\boxed{}``), ``gsm8k`` (a ``#### x`` line), ``answer_tag`` (``<answer>...</answer>``) or ``code``
  (a fenced code block).
- ``length``: a penalty in [-1, 0] (DAPO's soft overlong punishment): 0 up to a budget of generated tokens, then
  linear down to -1 at ``task.sampling.max_tokens``. The budget is ``task.metadata["length_budget"]``, else three
  quarters of ``max_tokens``; a budget at or past ``max_tokens`` reaches -1 at twice the budget.
- ``code``: the response's last fenced code block runs in the sandbox with the tests in ``task.metadata["tests"]``
  (a JSON list of Python snippets, e.g. ``["assert f(1) == 2", ...]``, or one snippet); the score is the share
  that pass, and a sandbox failure class (timeout, memory, cpu, crash, sandbox_error) is a violation.

A task without what a verifier needs (no answer, no pattern, no tests) raises InvalidRecord: the trajectory is
dead-lettered with that reason, since no judge could score it.
"""
from __future__ import annotations

import json
import re
import secrets
import threading
import unicodedata
from typing import Callable

from rlstream.rewards.api import RewardResult, final_text
from rlstream.rewards.builtin import calculator_reward, calculator_turns, exact_match, normalise_answer
from rlstream.runtime.stage import InvalidRecord
from rlstream.sandbox import Sandbox
from rlstream.schemas.records import Trajectory

_GSM8K = re.compile(r"####[ \t]*([^\n]*\S)")
# A number not glued to a preceding digit or point: thousands separators, decimals and a/b fractions included.
_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+(?:\.\d+)?)?")
_INLINE_MATH = re.compile(r"\$[^$\n]+\$")
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def _result(key: str, score: float, version: int, violations: list[str] | None = None) -> RewardResult:
    """A one-part RewardResult, the shape every built-in verifier returns."""
    return RewardResult(score, {key: score}, violations or [], verifier_version=f"{key}/{version}")


def _metadata(trajectory: Trajectory, key: str, verifier: str) -> str:
    """A task metadata value a verifier cannot do without."""
    value = trajectory.task.metadata.get(key)
    if not value:
        raise InvalidRecord(f"{verifier} needs task.metadata[{key!r}]")
    return value


# -- math -------------------------------------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` whose braces balance, or None."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth, opening = 0, start + len("\\boxed")
        for i in range(opening, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[opening + 1:i]
        start = text.rfind("\\boxed{", 0, start)  # this one never closes: try the one before
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response: the last ``\\boxed{...}`` (kept boxed, for math-verify's LaTeX reading),
    else the last ``#### x``, else the last number or ``$...$`` span; None when there is none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return f"\\boxed{{{boxed}}}" if boxed.strip() else None
    marked = _GSM8K.findall(text)
    if marked:
        return marked[-1].strip()
    # The last number, or the last $...$ span when that ends later: "so it is $\frac{1}{2}$" means 1/2, not 2.
    last = max((m for pattern in (_NUMBER, _INLINE_MATH) for m in pattern.finditer(text)), key=lambda m: m.end(),
               default=None)
    return last.group(0) if last else None


def _parse_math(text: str) -> list:
    """math-verify's reading of ``text``; bare LaTeX (``x^2+1``) is retried inside ``$...$``."""
    # Imported on first use (here and in math_answer): sympy takes a second to load, which every process importing
    # rlstream.rewards (the trainer, the CLI) would pay.
    from math_verify import parse
    return parse(text, parsing_timeout=None) or parse(f"${text}$", parsing_timeout=None)


def math_answer(trajectory: Trajectory) -> RewardResult:
    """1.0 when the response's final answer is mathematically equivalent to ``task.answer`` (math-verify)."""
    from math_verify import verify
    answer = trajectory.task.answer
    if not answer or not answer.strip():
        raise InvalidRecord("math needs task.answer")
    # A gold answer written as a worked solution ("... #### 72") is compared by its final answer; a bare one is the
    # content of a box (math-verify reads "\{1, 2\}" as the set only inside math delimiters).
    if "####" in answer or "\\boxed{" in answer:
        gold = _parse_math(extract_answer(answer) or answer)
    else:
        gold = _parse_math(answer if "$" in answer else f"\\boxed{{{answer}}}") or _parse_math(answer)
    if not gold:
        raise InvalidRecord(f"math: task.answer {answer[:80]!r} does not parse as math")
    predicted = extract_answer(normalise_answer(final_text(trajectory)))
    if predicted is None:
        return _result("math", 0.0, 1, ["no_answer"])
    parsed = _parse_math(predicted)
    if not parsed:
        return _result("math", 0.0, 1, ["unparsable_answer"])
    return _result("math", 1.0 if verify(gold, parsed, timeout_seconds=None) else 0.0, 1)


# -- exact, normalized, regex, format -----------------------------------------------------------------------------


def _is_punct(ch: str) -> bool:
    """Unicode punctuation (ASCII's and curly quotes, dashes, ...); symbols such as $ or + are not."""
    return unicodedata.category(ch).startswith("P")


def normalise_loose(text: str) -> str:
    """Case-folded, NFKC, whitespace collapsed, punctuation stripped from each word's edges (a minus before a
    digit kept)."""
    words = []
    for word in unicodedata.normalize("NFKC", normalise_answer(text)).casefold().split():
        start, end = 0, len(word)
        while start < end and _is_punct(word[start]):
            start += 1
        while end > start and _is_punct(word[end - 1]):
            end -= 1
        sign = "-" if start > 0 and word[start - 1] == "-" and word[start].isdigit() else ""
        if start < end:
            words.append(sign + word[start:end])
    return " ".join(words)


def normalized_match(trajectory: Trajectory) -> RewardResult:
    """1.0 when the response equals ``task.answer`` after ``normalise_loose``."""
    answer = trajectory.task.answer
    if answer is None:
        raise InvalidRecord("normalized needs task.answer")
    return _result("normalized", float(normalise_loose(final_text(trajectory)) == normalise_loose(answer)), 1)


def regex_reward(pattern: str, key: str = "regex") -> Callable[[Trajectory], RewardResult]:
    """A verifier scoring 1.0 when ``pattern`` is found in the response (fixed pattern, e.g. a module attribute
    loaded as ``mypkg.rewards:has_date`` after ``has_date = regex_reward(r"\\d{4}-\\d{2}-\\d{2}")``)."""
    compiled = re.compile(pattern)

    def regex_fixed(trajectory: Trajectory) -> RewardResult:
        return _result(key, float(compiled.search(normalise_answer(final_text(trajectory))) is not None), 1)

    regex_fixed.__doc__ = f"1.0 when /{pattern}/ is found in the response."
    return regex_fixed


def regex_match(trajectory: Trajectory) -> RewardResult:
    """1.0 when the task's ``metadata["regex"]`` is found in the response."""
    pattern = _metadata(trajectory, "regex", "regex")
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise InvalidRecord(f"regex: task.metadata['regex'] {pattern!r} does not compile: {exc}") from None
    return _result("regex", float(compiled.search(normalise_answer(final_text(trajectory))) is not None), 1)


#: Response shapes the ``format`` verifier knows, by the name ``task.metadata["format"]`` gives.
FORMATS: dict[str, Callable[[str], bool]] = {
    "boxed": lambda text: bool((last_boxed(text) or "").strip()),
    "gsm8k": lambda text: _GSM8K.search(text) is not None,
    "answer_tag": lambda text: re.search(r"<answer>\s*\S.*?</answer>", text, re.DOTALL) is not None,
    "code": lambda text: _CODE_BLOCK.search(text) is not None,
}


def format_check(trajectory: Trajectory) -> RewardResult:
    """1.0 when the response has the shape ``task.metadata["format"]`` names (default: an answer in ``\\boxed{}``)."""
    name = trajectory.task.metadata.get("format") or "boxed"
    if name not in FORMATS:
        raise InvalidRecord(f"format: unknown task.metadata['format'] {name!r}; known: {', '.join(FORMATS)}")
    return _result("format", float(FORMATS[name](final_text(trajectory))), 1)


# -- length -------------------------------------------------------------------------------------------------------


def length_penalty(trajectory: Trajectory) -> RewardResult:
    """0 up to the token budget, then linear down to -1 (see the module docstring for the budget)."""
    limit = trajectory.task.sampling.max_tokens
    raw = trajectory.task.metadata.get("length_budget")
    try:
        budget = int(raw) if raw else limit * 3 // 4
    except ValueError:
        raise InvalidRecord(f"length: task.metadata['length_budget'] {raw!r} is not a whole number") from None
    if budget <= 0:
        raise InvalidRecord(f"length: the budget must be positive, not {budget}")
    # Generated tokens are the ones the loss covers; tool observations between turns are not the model's.
    generated = sum(trajectory.loss_mask) if trajectory.loss_mask else len(trajectory.token_ids)
    span = limit - budget if limit > budget else budget
    penalty = -min(1.0, max(0, generated - budget) / span)
    return _result("length", penalty + 0.0, 1)  # + 0.0: no -0.0 in the breakdown


# -- code ---------------------------------------------------------------------------------------------------------

_sandbox: Sandbox | None = None
_sandbox_lock = threading.Lock()

# Runs after the solution in the same process. Each verdict line carries a nonce the solution never sees printed,
# so a solution that exits early (sys.exit(0), os._exit(0)) passes nothing. A solution written to read the harness
# out of its own process could still forge one: the sandbox contains such code, it does not out-judge it.
_HARNESS = '''
import io as _io, os as _os, sys as _sys
_out = _os.fdopen(_os.dup(1), "w")
_sys.stdout = _sys.stderr = _io.StringIO()
_g = {"__name__": "solution"}
try:
    exec(compile(%(solution)r, "solution.py", "exec"), _g)
    _ok = True
except BaseException:
    _ok = False
for _i, _test in enumerate(%(tests)r):
    _passed = False
    if _ok:
        try:
            exec(compile(_test, "test_%%d.py" %% _i, "exec"), _g)
            _passed = True
        except BaseException:
            pass
    _sys.stdout = _sys.stderr = _io.StringIO()
    print(%(nonce)r, _i, "pass" if _passed else "fail", file=_out, flush=True)
'''


def code_sandbox() -> Sandbox:
    """The sandbox the ``code`` verifier runs in: one per process, made on first use."""
    global _sandbox
    with _sandbox_lock:
        if _sandbox is None:
            _sandbox = Sandbox()
        return _sandbox


def _tests(trajectory: Trajectory) -> list[str]:
    """The task's tests: a JSON list of snippets, or one snippet."""
    raw = _metadata(trajectory, "tests", "code")
    try:
        tests = json.loads(raw)
    except ValueError:
        return [raw]
    if isinstance(tests, str):
        return [tests]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise InvalidRecord("code: task.metadata['tests'] must be a non-empty JSON list of strings, or a snippet")
    return tests


def code_tests(trajectory: Trajectory) -> RewardResult:
    """The share of the task's tests the response's last code block passes in the sandbox."""
    tests = _tests(trajectory)
    blocks = _CODE_BLOCK.findall(final_text(trajectory))
    if not blocks:
        return _result("code", 0.0, 1, ["no_code"])
    nonce = secrets.token_hex(16)
    result = code_sandbox().run_python(_HARNESS % {"solution": blocks[-1], "tests": tests, "nonce": nonce})
    passed = set()
    for line in result.output.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and parts[2] == "pass":
            passed.add(parts[1])
    score = len(passed & {str(i) for i in range(len(tests))}) / len(tests)
    return _result("code", score, 1, [result.failure_class] if result.failure_class else [])


#: Built-in verifiers by the name ``--reward`` takes (``rlstream.rewards.compose``).
VERIFIERS: dict[str, Callable[[Trajectory], RewardResult]] = {
    "math": math_answer,
    "exact": exact_match,
    "normalized": normalized_match,
    "regex": regex_match,
    "format": format_check,
    "length": length_penalty,
    "code": code_tests,
    "calculator": calculator_reward,
    "calculator_turns": calculator_turns,
}

"""The report's plain-units numbers, version-range folding and one-line readings, on hand-made figures."""
import pytest

from rlstream.archive.readings import by_version_ranges, human, percent, reading


@pytest.mark.parametrize("value, text", [
    (3_293_000.0, "3.29 M"), (12480, "12,480"), (12480.0, "12,480"), (1234.56, "1,235"), (85.34, "85.3"),
    (0.41234, "0.412"), (0, "0"), (None, "—"), (float("nan"), "—"), ("rollout", "rollout"), (2.5e9, "2.5 G"),
])
def test_numbers_read_without_scientific_notation(value, text):
    assert human(value) == text


def test_percent():
    assert percent(0.0213) == "2.1 %" and percent(None) == "—"


def test_a_long_per_version_table_folds_into_ranges_summing_counts_and_averaging_the_rest():
    fig = {"columns": ["version", "accepted", "stale_ratio"], "rows": [[v, 10, v / 100] for v in range(100)]}
    folded = by_version_ranges(fig, max_rows=10)
    assert len(folded["rows"]) == 10 and folded["folded_from"] == 100
    assert folded["rows"][0] == ["0–9", 100.0, pytest.approx(0.045)]
    assert folded["rows"][-1][0] == "90–99"
    short = {"columns": ["version", "accepted"], "rows": [[1, 2]]}
    assert by_version_ranges(short) is short


def test_series_fold_separately():
    fig = {"columns": ["policy_version", "reward_version", "split", "samples", "reward_mean"],
           "rows": [[v, "v1", split, 8, v / 40] for split in ("train", "heldout") for v in range(40)]}
    folded = by_version_ranges(fig, "policy_version", max_rows=8)
    assert {tuple(r[1:3]) for r in folded["rows"]} == {("v1", "train"), ("v1", "heldout")}
    assert len(folded["rows"]) == 8 and folded["rows"][0][:4] == ["0–9", "v1", "train", 80.0]


def test_readings_say_what_each_figure_shows():
    reward = {"columns": ["policy_version", "reward_version", "split", "samples", "reward_mean", "reward_std"],
              "rows": [[0, "v1", "heldout", 8, 0.1, 0], [5, "v1", "heldout", 8, 0.9, 0], [9, "v1", "heldout", 8,
                                                                                            0.8, 0]]}
    assert reading("reward by policy and reward version", reward) == \
        "heldout reward 0.1 at v0 → 0.8 at v9 (best 0.9 at v5)"
    failures = {"columns": ["source", "stage", "failure_class", "failures", "trajectories", "rate", "is_timeout"],
                "rows": []}
    assert reading("timeout and failure rates by class", failures) == "no failures, timeouts or dead letters"
    failures["rows"] = [["trajectory", "env", "sandbox_timeout", 12, 400, 0.03, True]]
    assert "sandbox_timeout at env (12, 3.0 % of trajectories)" in reading("timeout and failure rates by class",
                                                                             failures)
    latency = {"columns": ["stage", "samples", "latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "queue_p50_ms",
                           "queue_p95_ms", "queue_p99_ms"],
               "rows": [["rollout", 9, 100.0, 200.0, 350.0, 5.0, 6.0, 7.0], ["reward", 9, 20.0, 30.0, 40.0, 1.0, 2.0,
                                                                               90.0],
                        ["end_to_end", 9, 900.0, 1000.0, 2000.0, None, None, None]]}
    assert reading("latency and queue delay per stage (ms)", latency) == (
        "the slowest stage at p99 is rollout (350 ms); the longest wait before a stage is at reward (90 ms p99); "
        "a trajectory takes 900 ms end to end at the median")
    assert reading("unknown figure", latency) == ""


def test_teacher_and_distillation_readings():
    teacher = {"columns": ["teacher_version", "policy_version", "samples", "without_feedback_rate",
                           "alignment_error_rate", "latency_p50_ms", "latency_p99_ms", "reverse_kl_mean",
                           "top1_agreement_mean", "teacher_verifier_disagreement"],
               "rows": [["big-v1", 0, 30, 0.1, 0.0, 5.0, 9.0, 0.5, 0.6, 0.0],
                        ["big-v1", 1, 10, 0.5, 0.2, 5.0, 9.0, 0.1, 0.2, 0.0]]}
    assert reading("teacher by version", teacher) == (
        "teacher big-v1: 40 samples, 20.0 % without feedback, 5.0 % not aligned, top-1 agreement 50.0 %, "
        "reverse KL 0.4")
    distill = {"columns": ["version", "opd_coef", "opd_kl", "kl_forward", "kl_reverse", "teacher_top1_agreement",
                           "loss_rl", "loss_opd"],
               "rows": [[1, 1.0, 2.5, 0, 0, 0, 0, 0], [9, 0.5, 0.75, 0, 0, 0, 0, 0]]}
    assert reading("distillation by version", distill) == "KL to the teacher 2.5 at v1 → 0.75 at v9 (λ 1 → 0.5)"

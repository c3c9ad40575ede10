"""The loop's chain per step, from samples' stage stamps: hand-computed hops, p50/p99 and shares."""
import pytest

from rlstream.trainer.chain import chain_stats, describe, summarize


def stamps(created, generated, env, scored):
    return {"prompt.created": created, "rollout.end": generated, "env.end": env, "reward.end": scored}


def test_a_steps_hops_are_medians_over_its_samples_up_to_the_steps_start():
    got = chain_stats([stamps(0, 100, 110, 150), stamps(0, 300, 320, 340), stamps(100, 200, 220, 260)], 1000)
    assert got == {"chain_generate_s": 0.1, "chain_env_s": 0.02, "chain_reward_s": 0.04, "chain_wait_s": 0.74,
                   "chain_to_step_s": 1.0, "chain_to_step_p99_s": 1.0}


def test_a_hop_no_sample_stamped_is_absent_not_zero():
    got = chain_stats([{"prompt.created": 0, "rollout.end": 50}], 200)
    assert got == {"chain_generate_s": 0.05, "chain_to_step_s": 0.2, "chain_to_step_p99_s": 0.2}
    assert chain_stats([], 5) == {}


def test_across_steps_each_hop_has_its_p50_p99_and_share_of_the_chain():
    steps = [{"chain_generate_s": g, "chain_env_s": 0.0, "chain_reward_s": 0.1, "chain_wait_s": 0.2,
              "step_seconds": 0.2, "chain_to_step_s": g + 0.3} for g in (0.5, 0.5, 0.5, 2.0)]
    s = summarize(steps)
    assert s["chain_generate_s"]["p50"] == 0.5 and s["chain_generate_s"]["p99"] == 2.0
    assert s["chain_generate_s"]["share"] == pytest.approx(0.5 / 1.0)
    assert s["step_seconds"]["share"] == pytest.approx(0.2)
    line = describe(s)
    assert line.startswith("chain per step: generate 0.50 s (50%), env 0.00 s (0%), reward 0.10 s (10%)")
    assert "prompt to step p50 0.80 s, p99 2.30 s" in line


def test_the_whole_chain_per_step_adds_the_steps_own_hops_to_the_wait_before_it():
    steps = [{"chain_to_step_s": w, "step_seconds": 0.1, "weights_s": 0.02, "commit_s": 0.01, "train_s": 0.09}
             for w in (0.2, 0.3, 0.4)] + [{"chain_to_step_s": 5.0}]  # a step without its own split: left out
    s = summarize(steps)
    assert s["chain_s"]["p50"] == pytest.approx(0.43) and s["chain_s"]["p99"] == pytest.approx(0.53)
    assert s["weights_s"]["share"] == pytest.approx(0.02 / 0.13)
    assert "prompt to published p50 0.43 s, p99 0.53 s" in describe(s)
    assert "write weights 0.02 s" in describe(s) and "announce 0.01 s" in describe(s)

"""The demo's live line says what the loop waits on before it has figures, then shows them."""
from rlstream.demo import Progress, live_line


def test_the_line_names_the_wait_before_figures_exist():
    p = Progress()
    assert live_line(p, None, 3, warming=True).startswith("starting: trainer supervised warm-up")
    assert "loading the model" in live_line(p, None, 3)
    p.version = 0
    assert "rollout engine starting" in live_line(p, None, 40)
    assert "nan" not in live_line(p, None, 40)


def test_the_line_shows_the_figures_once_samples_are_scored():
    p = Progress(version=7)
    p.train_rewards.extend([0.0, 1.0])
    line = live_line(p, None, 61)
    assert line.startswith("v7") and "held-out   - " in line and "train 0.50" in line and "nan" not in line
    assert "held-out 0.42" in live_line(p, (6, 0.42), 61)


def test_no_rate_is_shown_over_a_burst_of_arrivals_only_over_a_real_span():
    """v0 printed 281162.1 samples/s: 64 records handed over within a fraction of a millisecond."""
    p = Progress(version=0)
    p.train_rewards.extend([1.0] * 64)
    p.train_times.extend(100.0 + i * 3e-6 for i in range(64))
    assert p.samples_per_s() is None
    line = live_line(p, None, 30)
    assert "     - samples/s" in line and "281" not in line
    p.train_times.clear()
    p.train_times.extend(100.0 + i * 0.5 for i in range(41))  # 40 samples over 20 s
    assert p.samples_per_s() == 2.0
    assert "   2.0 samples/s" in live_line(p, None, 30)

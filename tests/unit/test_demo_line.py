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

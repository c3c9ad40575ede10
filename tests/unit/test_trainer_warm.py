"""What a trainer's warm standby builds its model's class from (rlstream/trainer/warm.py): the version a takeover
would resume, else the --model folder, else nothing."""
from __future__ import annotations

from types import SimpleNamespace

from rlstream.policy.uris import COMPLETE
from rlstream.policy.weights import WeightStore
from rlstream.trainer.warm import model_spec


def service(store: str, model: str):
    return SimpleNamespace(store=WeightStore(store), loop=SimpleNamespace(policy="policy"),
                           settings=SimpleNamespace(model=model))


def test_the_newest_stored_version_else_a_local_model_else_nothing(tmp_path):
    model = tmp_path / "base"
    model.mkdir()
    store = tmp_path / "store"
    assert model_spec(service(str(store), str(model))) == str(model)  # nothing stored yet: --model's folder
    assert model_spec(service(str(store), "tiny")) == ""  # built in code: no config to read
    assert model_spec(service(str(store), "Qwen/Qwen3-0.6B")) == ""  # a hub id: nothing fetched to warm
    for v in (0, 2, 10, 11):
        (store / "policy" / f"v{v}").mkdir(parents=True)
        if v != 11:  # v11 is being written: not complete, not resumed
            (store / "policy" / f"v{v}" / COMPLETE).touch()
    assert model_spec(service(str(store), str(model))) == str((store / "policy" / "v10").resolve())
    # A remote store is not listed for it: the class loads at takeover.
    assert model_spec(service("memory://warm-test/store", str(model))) == str(model)

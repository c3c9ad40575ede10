"""A lock file left in DeepSpeed's op folder is named in a warning before DeepSpeed would wait on it for ever."""
import logging
import os
import time

from torch.utils.cpp_extension import _get_build_directory

from rlstream.trainer.distributed import warn_of_a_left_lock


def test_an_old_lock_is_named_and_a_fresh_one_or_none_is_not(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert warn_of_a_left_lock() is None  # no folder, no lock
    lock = tmp_path / os.path.relpath(_get_build_directory("deepspeed_shm_comm", verbose=False), tmp_path) / "lock"
    lock.touch()  # a build in progress: its lock is new
    with caplog.at_level(logging.WARNING):
        assert warn_of_a_left_lock() is None
        assert not caplog.records
        hour_ago = time.time() - 3600
        os.utime(lock, (hour_ago, hour_ago))
        assert warn_of_a_left_lock() == lock
    assert str(lock) in caplog.text and "delete that file" in caplog.text

"""``rlstream topics --partitions N --topic-partitions TOPIC=N``: the counts each topic gets, and the ones refused
before the broker is asked (the co-partitioned episode topics must stay equal)."""
import pytest

from rlstream.cli import main
from rlstream.errors import UserError
from rlstream.kafka.topics import CO_PARTITIONED, TOPICS, partition_counts


def test_each_topic_keeps_its_own_count_unless_told():
    assert partition_counts() == {name: spec.partitions for name, spec in TOPICS.items()}
    counts = partition_counts(16, {"rewards": 32})
    assert counts["rewards"] == 32 and counts["policy-versions"] == 1
    assert all(counts[t] == 16 for t in CO_PARTITIONED) and counts["dead-letters"] == 16


def test_counts_that_break_the_loop_are_refused_with_the_reason():
    with pytest.raises(UserError, match="must have the same partition count"):
        partition_counts(None, {"prompts": 16})
    with pytest.raises(UserError, match="ordered log"):
        partition_counts(None, {"policy-versions": 2})
    with pytest.raises(UserError, match="no topic promtps"):
        partition_counts(None, {"promtps": 4})
    with pytest.raises(UserError, match="at least 1"):
        partition_counts(0)


def test_the_command_refuses_a_bad_flag_before_it_needs_a_broker(capsys):
    assert main(["topics", "--run", "r", "--bootstrap", "127.0.0.1:1", "--topic-partitions", "rewards"]) == 2
    assert "expected TOPIC=N" in capsys.readouterr().err
    assert main(["topics", "--run", "r", "--bootstrap", "127.0.0.1:1", "--topic-partitions", "actions=3"]) == 1
    assert "same partition count" in capsys.readouterr().err

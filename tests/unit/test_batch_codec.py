"""The batch codec (Codec.decode_many / encode_many, TokenList) against fastavro's record-at-a-time path: every
record type, every frozen schema version, bit for bit (property tests over random records of each schema)."""
import io
import json
import pickle
import struct

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlstream.schemas import records
from rlstream.schemas.codec import (MARKER, RECORDS, Codec, DecodeError, _pack_record, _unpack_record, iter_history,
                                    load_current, packed_paths, schema_fingerprint)
from rlstream.schemas.packed import TokenList, TokenView, pack, unpack

CODEC = Codec()
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)
_FLOAT32 = st.floats(width=32, allow_nan=False)
_PACKED = {"int32": st.integers(-2**31, 2**31 - 1), "uint8": st.integers(0, 255), "float32": _FLOAT32}


def datum(schema):
    """A strategy of values of an expanded Avro schema (a packed field: the bytes of a list of its kind)."""
    if isinstance(schema, list):
        return st.one_of([datum(branch) for branch in schema])
    kind = schema if isinstance(schema, str) else schema["type"]
    if isinstance(kind, (dict, list)):
        return datum(kind)
    simple = {"null": st.none(), "boolean": st.booleans(), "int": st.integers(-2**31, 2**31 - 1),
              "long": st.integers(-2**63, 2**63 - 1), "float": _FLOAT32, "double": st.floats(allow_nan=False),
              "string": _TEXT, "bytes": st.binary(max_size=8)}
    if kind in simple:
        return simple[kind]
    if kind == "array":
        return st.lists(datum(schema["items"]), max_size=2)
    if kind == "map":
        return st.dictionaries(_TEXT, datum(schema["values"]), max_size=1)
    if kind == "enum":
        return st.sampled_from(schema["symbols"])
    if kind == "fixed":
        return st.binary(min_size=schema["size"], max_size=schema["size"])
    assert kind == "record", kind
    fields = {}
    for f in schema["fields"]:
        if "rlstream.packed" in f:
            fields[f["name"]] = st.lists(_PACKED[f["rlstream.packed"]], max_size=5).map(
                lambda v, k=f["rlstream.packed"]: pack(v, k))
        else:
            fields[f["name"]] = datum(f["type"])
    return st.fixed_dictionaries(fields)


# Every writer the codec knows: each record's current schema and each frozen version.
WRITERS = [(name, 0, load_current(name)) for name in RECORDS] + [
    (name, version, json.loads(path.read_text())) for name, version, path in iter_history()]


_BATCHES: dict = {}  # (record, version) -> strategy of a batch of its values, built once


def _one_at_a_time(name: str, writer: dict, value: bytes) -> dict:
    """fastavro's own path: one schemaless_reader call resolving this writer against the current schema."""
    current = parse_schema(load_current(name))
    body = io.BytesIO(value)
    body.seek(10)
    decoded = schemaless_reader(body, parse_schema(writer), current)
    _unpack_record(decoded, packed_paths(load_current(name)))
    return decoded


def _write(schema: dict, value: dict) -> bytes:
    parsed = parse_schema(schema)
    buf = io.BytesIO()
    buf.write(MARKER + schema_fingerprint(parsed))
    schemaless_writer(buf, parsed, value)
    return buf.getvalue()


@pytest.mark.parametrize("name,version,writer", WRITERS, ids=lambda v: str(v) if not isinstance(v, dict) else "")
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_batch_decode_and_encode_match_fastavro_record_at_a_time(name, version, writer, data):
    key = (name, version)
    if key not in _BATCHES:
        _BATCHES[key] = st.lists(datum(writer), min_size=2, max_size=2)
    values = [_write(writer, v) for v in data.draw(_BATCHES[key])]
    batch = CODEC.decode_many(values, expect=name)
    for value, got in zip(values, batch):
        assert got == (name, _one_at_a_time(name, writer, value))
    # Encoding the batch again writes what fastavro writes for the same records under the current schema; for a
    # record written with it, that is the bytes it arrived as (the typed records in between change nothing).
    typed = [records.RECORD_TYPES[name].from_dict(d).to_dict() for _, d in batch]
    encoded = CODEC.encode_many(name, typed)
    assert encoded == [CODEC.encode(name, d) for _, d in batch]
    if version == 0:
        assert encoded == values
    assert CODEC.decode_many(encoded, expect=name) == batch
    # Read-only views over the bytes (Stage.token_views) decode to the same elements and encode to the same bytes.
    viewed = CODEC.decode_many(values, expect=name, views=True)
    assert viewed == batch
    assert CODEC.encode_many(name, [records.RECORD_TYPES[name].from_dict(d).to_dict() for _, d in viewed]) == encoded


def test_one_bad_value_in_a_batch_fails_alone_with_its_reason():
    good = CODEC.encode("Task", records.Task("t", "g", "n", "e", "1", "p", records.SamplingParams(), 1).to_dict())
    batch = CODEC.decode_many([good, b"junk", None, good[:-3],
                               CODEC.encode("DeadLetter", records.DeadLetter("s", "r", "e", "t", 0, 0, 0).to_dict()),
                               b"\xc3\x01" + b"\x00" * 8, good], expect="Task")
    reasons = [r.reason if isinstance(r, DecodeError) else r[0] for r in batch]
    assert reasons == ["Task", "malformed", "malformed", "malformed", "wrong_record", "unknown_schema", "Task"]


def test_a_changed_token_list_is_packed_afresh():
    tokens = unpack(pack([1, 2, 3], "int32"), "int32")
    assert isinstance(tokens, TokenList) and tokens == [1, 2, 3] and tokens.packed_as("int32") is not None
    for change in (lambda t: t.append(4), lambda t: t.__setitem__(0, 9), lambda t: t.__iadd__([5]),
                   lambda t: t.sort(reverse=True), lambda t: t.pop(), lambda t: t.__delitem__(slice(0, 1)),
                   lambda t: t.extend([7]), lambda t: t.insert(0, 8), lambda t: t.clear(), lambda t: t.reverse()):
        t = unpack(pack([1, 2, 3], "int32"), "int32")
        change(t)
        assert t.packed_as("int32") is None
        assert pack(t, "int32") == struct.pack(f"<{len(t)}i", *t)
    # The bytes are kept for their own kind only, and a copy is a plain list.
    assert tokens.packed_as("float32") is None
    assert type(pickle.loads(pickle.dumps(tokens))) is list


def test_a_pass_through_record_reuses_its_token_bytes():
    traj = records.Trajectory("e", "g", 0, records.Task("t", "g", "n", "e", "1", "p", records.SamplingParams(), 1),
                              "r", 0, 0, token_ids=list(range(50)), loss_mask=[1] * 50,
                              behaviour_logprobs=[-0.5] * 50)
    value = CODEC.encode("Trajectory", traj.to_dict())
    (_, decoded), = CODEC.decode_many([value], expect="Trajectory")
    typed = records.Trajectory.from_dict(decoded)
    assert isinstance(typed.token_ids, TokenList)
    scored = records.ScoredTrajectory(typed, records.Reward(total=1.0, reward_version="v"))
    fresh = records.ScoredTrajectory(traj, records.Reward(total=1.0, reward_version="v"))
    assert CODEC.encode_many("ScoredTrajectory", [scored.to_dict()]) == [CODEC.encode("ScoredTrajectory",
                                                                                      fresh.to_dict())]


def test_a_token_view_reads_like_the_list_of_its_elements():
    view = unpack(pack([3, -1, 7], "int32"), "int32", view=True)
    assert isinstance(view, TokenView) and view == [3, -1, 7] and [3, -1, 7] == view and view != [3, -1]
    assert len(view) == 3 and view[1] == -1 and view[-2:] == [-1, 7] and list(view) == [3, -1, 7] and 7 in view
    assert view + [1] == [3, -1, 7, 1] and [0] + view == [0, 3, -1, 7] and sum(view) == 9 and repr(view) == "[3, -1, 7]"
    import numpy as np
    assert np.asarray(view).tolist() == [3, -1, 7] and type(pickle.loads(pickle.dumps(view))) is list
    assert pack(view, "int32") == struct.pack("<3i", 3, -1, 7) and view.packed_as("float32") is None
    with pytest.raises(AttributeError):
        view.append(1)  # read-only: a stage that edits tokens in place keeps lists (Stage.token_views False)
    floats = unpack(pack([0.5, -2.0], "float32"), "float32", view=True)
    assert floats == [0.5, -2.0] and isinstance(floats[0], float)
    with pytest.raises((ValueError, TypeError)):
        unpack(b"\x01\x02\x03", "int32", view=True)


# -- writing a scored trajectory over its trajectory's arrived bytes (schemas.splice) --------------------------------

_SPLICE = None


def _splice():
    global _SPLICE
    if _SPLICE is None:
        from rlstream.schemas.splice import Splice
        _SPLICE = Splice("ScoredTrajectory", carried="trajectory", tail_from="stage_times")
    return _SPLICE


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(trajectory=datum(load_current("Trajectory")), reward=datum(load_current("Reward")),
       stage_time=st.tuples(_TEXT, st.integers(-2**63, 2**63 - 1)))
def test_a_spliced_scored_trajectory_is_the_bytes_encoding_it_whole_writes(trajectory, reward, stage_time):
    wire = CODEC.encode("Trajectory", trajectory)
    (_, decoded), = CODEC.decode_many([wire], expect="Trajectory", views=True)
    typed = records.Trajectory.from_dict(decoded)
    kept = _splice().keep(wire, typed)
    assert kept is not None
    typed.stage_times[stage_time[0]] = stage_time[1]  # what the reward stage changes: the tail, after keep
    scored = records.ScoredTrajectory(typed, records.Reward.from_dict(reward))
    assert _splice().encode(kept, scored) == CODEC.encode("ScoredTrajectory", scored.to_dict())


def test_arrived_bytes_that_cannot_be_reused_are_refused():
    traj = records.Trajectory("e", "g", 0, records.Task("t", "g", "n", "e", "1", "p", records.SamplingParams(), 1),
                              "r", 0, 0, token_ids=[1, 2], loss_mask=[1, 1], behaviour_logprobs=[-0.5, -0.5],
                              stage_times={"env.end": 5, "rollout.end": 3}, trace_id="t1")
    wire = CODEC.encode("Trajectory", traj.to_dict())
    assert _splice().keep(wire, traj) is not None
    assert _splice().keep(None, traj) is None  # nothing arrived (a replay from the archive)
    # Written with an older schema: its bytes are not the current schema's body.
    old = _older_trajectory(traj)
    assert _splice().keep(old, records.Trajectory.from_dict(CODEC.decode(old)[1])) is None
    # The same values with stage_times written in two map blocks (legal Avro, not what the codec writes).
    tail = CODEC.encode("Trajectory", records.Trajectory(**{**_fields(traj), "stage_times": {}, "trace_id": ""})
                        .to_dict())
    assert tail.endswith(b"\x00\x00")  # an empty map's end, then an empty string
    block = lambda k, v: b"\x02" + bytes([len(k) * 2]) + k.encode() + bytes([v * 2])  # noqa: E731 - one entry
    two_blocks = tail[:-2] + block("env.end", 5) + block("rollout.end", 3) + b"\x00" + b"\x04t1"
    assert CODEC.decode(two_blocks)[1]["stage_times"] == {"env.end": 5, "rollout.end": 3}
    assert _splice().keep(two_blocks, traj) is None
    # A tail that changed before keep (the stage time already added) no longer matches the bytes.
    traj.stage_times["reward.end"] = 9
    assert _splice().keep(wire, traj) is None


def _fields(record) -> dict:
    return {f: getattr(record, f) for f in record.__dataclass_fields__}


def _older_trajectory(traj) -> bytes:
    """``traj`` written with the first frozen Trajectory schema (the fields it lacks left out)."""
    path = next(p for n, v, p in iter_history() if n == "Trajectory")
    schema = json.loads(path.read_text())
    return _write(schema, _pack_record(traj.to_dict(), packed_paths(schema)))


def test_the_reward_stage_writes_its_scored_trajectory_over_the_arrived_bytes():
    from rlstream.kafka.records import Decoder
    from rlstream.stages.reward import RewardSettings, RewardStage
    traj = records.Trajectory("e", "g", 0, records.Task("t", "g", "n", "e", "1", "p", records.SamplingParams(), 1,
                                                        answer="r"), "r", 0, 0, token_ids=[1, 2], loss_mask=[1, 1],
                              behaviour_logprobs=[-0.5, -0.5], stage_times={"env.end": 5})
    wire = CODEC.encode("Trajectory", traj.to_dict())
    stage = RewardStage(RewardSettings(reward="exact"))
    outputs = []
    for arrived in (wire, None):  # from the topic, and from nowhere (the archive's replay)
        item = Decoder("r", token_views=True).decode([_Message("r.trajectories", wire)])[0].item
        item.wire = arrived
        [[out]] = stage.handle_batch([item])
        assert (out.value is None) == (arrived is None)
        outputs.append(out)
    assert outputs[0].value() == CODEC.encode("ScoredTrajectory", outputs[0].record.to_dict())
    decoded = records.ScoredTrajectory.from_dict(CODEC.decode(outputs[0].value())[1])
    assert decoded.trajectory.stage_times.keys() == {"env.end", "reward.end"} and decoded.reward.total == 1.0


def test_a_replay_writes_its_scored_trajectory_over_the_arrived_bytes_with_its_start_in_the_tail():
    """A replay stamps replay.start after the arrived bytes are kept: stamped before (as it once was), the tail no
    longer matched them and every replayed trajectory was encoded whole."""
    from rlstream.kafka.records import Decoder
    from rlstream.stages.replay import ReplaySettings, ReplayStage
    traj = records.Trajectory("e", "g", 0, records.Task("t", "g", "n", "e", "1", "p", records.SamplingParams(), 1,
                                                        answer="r"), "r", 0, 0, token_ids=[1, 2], loss_mask=[1, 1],
                              behaviour_logprobs=[-0.5, -0.5], stage_times={"env.end": 5, "reward.end": 6})
    wire = CODEC.encode("Trajectory", traj.to_dict())
    stage = ReplayStage(ReplaySettings(reward="exact", reward_version="v2"))
    item = Decoder("r", token_views=True).decode([_Message("r.trajectories", wire)])[0].item
    [[out]] = stage.handle_batch([item])
    assert out.value is not None  # spliced
    assert out.value() == CODEC.encode("ScoredTrajectory", out.record.to_dict())
    decoded = records.ScoredTrajectory.from_dict(CODEC.decode(out.value())[1])
    times = decoded.trajectory.stage_times
    assert times.keys() == {"env.end", "reward.end", "replay.start"} and times["replay.start"] <= times["reward.end"]
    assert decoded.reward.reward_version == "v2" and decoded.reward.total == 1.0


class _Message:
    """The little of a confluent Message that the Decoder reads (a unit test of the codec, not of Kafka)."""

    def __init__(self, topic, value):
        self._topic, self._value = topic, value

    def topic(self): return self._topic
    def partition(self): return 0
    def offset(self): return 0
    def key(self): return b"g"
    def value(self): return self._value
    def headers(self):
        from rlstream.schemas import headers
        return headers.build(0, headers.new_traceparent())

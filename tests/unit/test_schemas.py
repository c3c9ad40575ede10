"""Codec round trips, schema evolution and the typed-record mirror."""
import dataclasses
import json
import typing

import pytest
from fastavro import parse_schema
from fastavro.utils import generate_many

from rlstream.schemas import records
from rlstream.schemas.codec import (HISTORY_DIR, RECORDS, Codec, DecodeError, _pack, iter_history, load_current,
                                    packed_paths, schema_fingerprint)


@pytest.fixture(scope="module")
def codec():
    return Codec()


def sample_task(**kw):
    base = dict(task_id="t1", group_id="t1", task_name="reverse", env_name="single", env_version="1",
                prompt="abc>", sampling=records.SamplingParams(temperature=0.7), created_at=123)
    base.update(kw)
    return records.Task(**base)


def sample_trajectory(n=16):
    return records.Trajectory(
        trajectory_id="e1", group_id="t1", sample_index=3, task=sample_task(), response="cba",
        min_policy_version=2, max_policy_version=3, token_ids=list(range(n)), loss_mask=[1] * n,
        behaviour_logprobs=[-0.5] * n,
        turns=[records.Turn("action", "cba", 0, n, policy_version=2,
                            tool_call=records.ToolCall("calc", "1+1"),
                            tool_result=records.ToolResult("2", duration_ms=1.5))],
        stage_times={"rollout.start": 1}, trace_id="abc")


def test_typed_round_trip(codec):
    traj = sample_trajectory()
    scored = records.ScoredTrajectory(traj, records.Reward(total=1.0, reward_version="r1", breakdown={"exact": 1.0}))
    name, value = codec.decode(codec.encode("ScoredTrajectory", scored.to_dict()))
    assert name == "ScoredTrajectory"
    assert records.ScoredTrajectory.from_dict(value) == scored


def test_value_carries_marker_and_fingerprint(codec):
    data = codec.encode("Task", sample_task().to_dict())
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == codec.fingerprint("Task")
    assert codec.record_name(data) == "Task"


@pytest.mark.parametrize("data,reason", [
    (b"", "malformed"),
    (b"garbage bytes that are not avro", "malformed"),
    (b"\xc3\x01" + b"\x00" * 8 + b"\x02", "unknown_schema"),
])
def test_bad_bytes_raise_with_reason(codec, data, reason):
    with pytest.raises(DecodeError) as err:
        codec.decode(data)
    assert err.value.reason == reason


def test_truncated_body_is_malformed(codec):
    data = codec.encode("Trajectory", sample_trajectory().to_dict())
    with pytest.raises(DecodeError) as err:
        codec.decode(data[: len(data) // 2])
    assert err.value.reason == "malformed"


def test_token_arrays_travel_packed_and_come_back_as_lists(codec):
    traj = sample_trajectory(n=1000)
    data = codec.encode("Trajectory", traj.to_dict())
    # 4 + 1 + 4 bytes per token instead of Avro's zig-zag varints and floats in blocks.
    assert len(data) < 10 * 1000
    _, value = codec.decode(data)
    assert value["token_ids"] == list(range(1000)) and value["loss_mask"] == [1] * 1000
    assert value["behaviour_logprobs"] == [-0.5] * 1000


def test_packed_array_of_wrong_length_is_malformed(codec):
    import io

    from fastavro import schemaless_writer
    fp, schema = codec._current["Task"]
    record = dict(sample_task().to_dict(), prompt_token_ids=b"\x01\x02\x03")  # 3 bytes: not an int32 array
    buf = io.BytesIO(b"\xc3\x01" + fp)
    buf.seek(0, 2)
    schemaless_writer(buf, schema, record)
    with pytest.raises(DecodeError) as err:
        codec.decode(buf.getvalue())
    assert err.value.reason == "malformed"


def test_wrong_record_type(codec):
    data = codec.encode("Task", sample_task().to_dict())
    with pytest.raises(DecodeError) as err:
        codec.decode(data, expect="Trajectory")
    assert err.value.reason == "wrong_record"


def test_current_schemas_are_frozen():
    latest = {}
    for name, version, path in iter_history():
        latest[name] = schema_fingerprint(json.loads(path.read_text()))
    for name in RECORDS:
        assert latest.get(name) == schema_fingerprint(load_current(name)), (
            f"{name} changed without a frozen version: run python -m rlstream.schemas.freeze")


@pytest.mark.parametrize("name,version,path", list(iter_history()), ids=lambda v: str(v))
def test_every_frozen_version_reads_under_the_current_schema(name, version, path):
    """Backward compatibility: data written with any old version decodes with the current schema."""
    import io

    from fastavro import schemaless_writer
    raw = json.loads(path.read_text())
    old = parse_schema(raw)
    codec = Codec()
    for value in generate_many(old, 5):
        for field_path, kind in packed_paths(raw):  # random bytes are not whole numbers of elements
            node = value
            for key in field_path[:-1]:
                node = node[key]
            node[field_path[-1]] = _pack([1, 2, 3], kind)
        buf = io.BytesIO()
        buf.write(b"\xc3\x01" + schema_fingerprint(old))
        schemaless_writer(buf, old, value)
        decoded_name, decoded = codec.decode(buf.getvalue())
        assert decoded_name == name
        records.RECORD_TYPES[name].from_dict(decoded)  # typed records accept it too


def test_old_policy_version_record_gets_new_field_default():
    """(d) A PolicyVersion written with v1 (before tokenizer_hash) decodes with the default."""
    import io

    from fastavro import schemaless_writer
    v1 = parse_schema(json.loads((HISTORY_DIR / "PolicyVersion" / "v1.avsc").read_text()))
    buf = io.BytesIO(b"\xc3\x01" + schema_fingerprint(v1))
    buf.seek(0, 2)
    schemaless_writer(buf, v1, {"policy": "p", "version": 7, "weights_uri": "file:///w/7", "step": 7,
                                "parent_version": 6, "samples_trained": 10, "metrics": {}, "trainer_id": "t",
                                "created_at": 1, "published_at": 2})
    name, value = Codec().decode(buf.getvalue())
    pv = records.PolicyVersion.from_dict(value)
    assert (name, pv.version, pv.tokenizer_hash) == ("PolicyVersion", 7, "")


def _avro_fields(schema):
    return {f["name"] for f in schema["fields"]}


def test_typed_records_mirror_the_schemas():
    schemas = {}

    def collect(s):
        if isinstance(s, dict):
            if s.get("type") == "record":
                schemas[s["name"].split(".")[-1]] = s
                for f in s["fields"]:
                    collect(f["type"])
            elif s.get("type") == "array":
                collect(s["items"])
        elif isinstance(s, list):
            for x in s:
                collect(x)

    for name in RECORDS:
        collect(load_current(name))
    assert set(schemas) == set(records.ALL_TYPES)
    for name, cls in records.ALL_TYPES.items():
        assert {f.name for f in dataclasses.fields(cls)} == _avro_fields(schemas[name]), name

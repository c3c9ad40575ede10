"""The dataset source without a broker: every format through the real ``datasets`` library, the column mapping,
its errors, bad rows as items with an error naming the row, and the fixed order that a resume recomputes."""
from __future__ import annotations

import json

import datasets
import pytest

from rlstream import cli
from rlstream.config import load as load_settings
from rlstream.errors import UsageError
from rlstream.sources.dataset import Columns, DatasetSource, load, source_id
from rlstream.sources.prompts import PromptSettings

ROWS = [{"prompt": "abc>", "answer": "cba", "level": 1},
        {"prompt": "xyz>", "answer": "zyx", "level": 2},
        {"prompt": "pq>", "answer": "qp", "level": 3}]


def write_jsonl(path, rows) -> str:
    """``rows`` as a JSONL file; its path."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def source(ds, columns=Columns(), **kw) -> DatasetSource:
    """A source over ``ds`` named ``t``."""
    return DatasetSource(ds, columns, path="data.jsonl", source_id="t", **kw)


@pytest.fixture
def saved(tmp_path):
    """The same rows in every format the source reads: name -> path."""
    ds = datasets.Dataset.from_list(ROWS)
    paths = {"jsonl": write_jsonl(tmp_path / "d.jsonl", ROWS)}
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "saved_dict"))
    paths.update(csv=str(tmp_path / "d.csv"), parquet=str(tmp_path / "d.parquet"), saved=str(tmp_path / "saved"),
                 saved_dict=str(tmp_path / "saved_dict"))
    return paths


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "saved", "saved_dict"])
def test_every_format_gives_the_same_tasks(saved, kind, tmp_path):
    ds = load(saved[kind], cache_dir=str(tmp_path / "cache"))
    src = source(ds, Columns(metadata=("level",)), group_size=4)
    items = list(src.items())
    assert [i.error for i in items] == [None] * 3
    tasks = [i.task for i in items]
    assert [(t.prompt, t.answer, t.metadata["level"]) for t in tasks] == [
        ("abc>", "cba", "1"), ("xyz>", "zyx", "2"), ("pq>", "qp", "3")]
    assert [t.task_id for t in tasks] == ["t-r0-e0", "t-r1-e0", "t-r2-e0"]
    assert all(t.group_id == t.task_id and t.group_size == 4 for t in tasks)
    assert tasks[1].metadata == {"level": "2", "source_id": "t", "epoch": "0", "row": "1"}


def test_a_csv_number_answer_becomes_text(tmp_path):
    (tmp_path / "n.csv").write_text("question,solution\nwhat is 2+2?,4\n")
    ds = load(str(tmp_path / "n.csv"), cache_dir=str(tmp_path / "cache"))
    [item] = source(ds, Columns(prompt="question", answer="solution")).items()
    assert (item.task.prompt, item.task.answer) == ("what is 2+2?", "4")


@pytest.mark.parametrize("columns, missing, flag", [
    (Columns(prompt="question"), "question", "--prompt-column"),
    (Columns(answer="reference"), "reference", "--answer-column"),
    (Columns(messages="chat"), "chat", "--messages-column"),
    (Columns(metadata=("level", "origin")), "origin", "--metadata-columns"),
    (Columns(id="uid"), "uid", "--id-column"),
])
def test_a_missing_column_names_it_and_lists_the_columns_present(columns, missing, flag):
    with pytest.raises(UsageError) as err:
        source(datasets.Dataset.from_list(ROWS), columns)
    message = str(err.value)
    assert f"no column {missing!r} ({flag})" in message
    assert "prompt, answer, level" in message


def test_no_answer_column_is_allowed_when_mapped_to_none():
    [item] = source(datasets.Dataset.from_list([{"prompt": "p"}]), Columns(answer="")).items()
    assert item.task.answer is None


def test_a_metadata_column_may_not_take_a_key_the_source_writes():
    with pytest.raises(UsageError, match="'row' is a metadata key the source writes itself"):
        source(datasets.Dataset.from_list([{"prompt": "p", "answer": "a", "row": 3}]), Columns(metadata=("row",)))


def test_unreadable_paths_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="--eval-dataset .*nope.jsonl: no such file or folder"):
        load(str(tmp_path / "nope.jsonl"), "--eval-dataset")
    (tmp_path / "d.txt").write_text("hello\n")
    with pytest.raises(UsageError, match="unknown format '.txt'"):
        load(str(tmp_path / "d.txt"))
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"\n')
    with pytest.raises(UsageError, match="broken.jsonl: cannot be read as a dataset"):
        load(str(tmp_path / "broken.jsonl"), cache_dir=str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="empty: cannot be read as a dataset"):
        load(str(tmp_path / "empty"))


def test_rows_that_cannot_become_tasks_are_errors_naming_their_row(tmp_path):
    rows = [{"prompt": "ok", "answer": "a"}, {"prompt": None, "answer": "b"}, {"prompt": "", "answer": "c"},
            {"prompt": "fine", "answer": None}]
    ds = load(write_jsonl(tmp_path / "bad.jsonl", rows), cache_dir=str(tmp_path / "cache"))
    items = list(source(ds).items())
    assert [i.error for i in items] == [None, "row 1: no prompt (column 'prompt' is empty)",
                                        "row 2: the prompt (column 'prompt') is an empty string", None]
    assert items[3].task.answer is None
    letter = source(ds).dead_letter(items[1])
    assert (letter.stage, letter.reason, letter.partition, letter.offset) == ("prompts", "invalid", 0, 1)
    assert "epoch 0, row 1: no prompt" in letter.error
    assert json.loads(letter.value) == {"prompt": None, "answer": "b"}


def test_a_prompt_that_is_not_text_is_an_error():
    ds = datasets.Dataset.from_list([{"prompt": 7, "answer": "a"}])
    [item] = source(ds).items()
    assert item.task is None and item.error == "row 0: the prompt (column 'prompt') is a int, not text"


def test_chat_messages_become_the_prompt_and_travel_in_metadata(tmp_path):
    rows = [{"chat": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "ref": "4"},
            {"chat": [], "ref": "x"},
            {"chat": [{"role": "user"}], "ref": "y"},
            {"chat": None, "ref": "z"}]
    ds = load(write_jsonl(tmp_path / "chat.jsonl", rows), cache_dir=str(tmp_path / "cache"))
    items = list(source(ds, Columns(messages="chat", answer="ref")).items())
    task = items[0].task
    assert task.prompt == "system: Be brief.\nuser: 2+2?\nassistant:"
    assert json.loads(task.metadata["messages"]) == rows[0]["chat"]
    assert task.answer == "4"
    assert items[1].error.startswith("row 1: messages must be a non-empty list")
    assert items[2].error.startswith("row 2: message 0 is not a {role: text, content: text}")
    assert items[3].error.startswith("row 3: messages must be a non-empty list of {role, content}, got NoneType")


def test_chat_makes_a_plain_prompt_a_user_message_after_the_system_prompt():
    ds = datasets.Dataset.from_list([{"question": "2+2?", "answer": "4"}])
    [plain] = source(ds, Columns(prompt="question")).items()
    assert plain.task.prompt == "2+2?" and "messages" not in plain.task.metadata
    [chat] = source(ds, Columns(prompt="question"), chat=True, system_prompt="Be brief.").items()
    assert json.loads(chat.task.metadata["messages"]) == [{"role": "system", "content": "Be brief."},
                                                          {"role": "user", "content": "2+2?"}]
    # A conversation that leads with its own system message keeps it.
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}]
    [kept] = source(datasets.Dataset.from_list([{"chat": own, "answer": "a"}]), Columns(messages="chat"),
                    system_prompt="Be brief.").items()
    assert json.loads(kept.task.metadata["messages"]) == own


def test_an_id_column_names_the_tasks_once_per_epoch():
    ds = datasets.Dataset.from_list([{"prompt": "p", "answer": "a", "uid": "q-17"}])
    items = list(source(ds, Columns(id="uid"), epochs=2).items())
    assert [i.task.task_id for i in items] == ["q-17-e0", "q-17-e1"]


def test_epochs_shuffle_each_pass_by_the_seed_and_a_resume_continues_the_same_order():
    ds = datasets.Dataset.from_list([{"prompt": f"p{i}", "answer": str(i)} for i in range(20)])
    src = source(ds, epochs=3, shuffle_seed=7)
    items = list(src.items())
    assert len(items) == len(src) == 60
    assert [i.seq for i in items] == list(range(60))
    epochs = [[i.row for i in items[e * 20:(e + 1) * 20]] for e in range(3)]
    assert all(sorted(rows) == list(range(20)) for rows in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(20))
    # A restarted source (a new object) at any position continues exactly where the first one was.
    again = source(ds, epochs=3, shuffle_seed=7)
    assert [(i.seq, i.epoch, i.row, i.task.task_id) for i in again.items(33)] == \
        [(i.seq, i.epoch, i.row, i.task.task_id) for i in items[33:]]
    assert [i.row for i in source(ds, epochs=2).items()] == list(range(20)) * 2
    assert [i.row for i in source(ds, epochs=1, shuffle_seed=8).items()] != epochs[0]


def test_source_ids_tell_datasets_and_mappings_apart(tmp_path):
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    assert source_id(a, Columns(), "train", -1) == source_id(a, Columns(), "train", -1)
    assert source_id(a, Columns(), "train", -1).startswith("a-")
    ids = {source_id(a, Columns(), "train", -1), source_id(b, Columns(), "train", -1),
           source_id(a, Columns(answer="ref"), "train", -1), source_id(a, Columns(), "heldout", -1),
           source_id(a, Columns(), "train", 3)}
    assert len(ids) == 5


def test_the_prompts_command_takes_the_dataset_flags(tmp_path):
    args = cli.build_parser("prompts").parse_args(
        ["prompts", "--dataset", "d.parquet", "--eval-dataset", "e.csv", "--messages-column", "chat",
         "--answer-column", "", "--metadata-columns", "a, b", "--epochs", "3", "--shuffle-seed", "5",
         "--source-id", "mine", "--batch-rows", "10", "--batch-pause", "0.5"])
    s = load_settings(PromptSettings, args)
    assert (s.dataset, s.eval_dataset, s.messages_column, s.answer_column, s.metadata_columns) == \
        ("d.parquet", "e.csv", "chat", "", "a, b")
    assert (s.epochs, s.shuffle_seed, s.source_id, s.batch_rows, s.batch_pause) == (3, 5, "mine", 10, 0.5)

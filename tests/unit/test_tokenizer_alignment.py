"""A teacher with another tokenizer: the student's tokens mapped onto the teacher's through character offsets, a
failure class where they cannot be, and a teacher refused at start when nothing aligns (both tokenizers named)."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from rlstream.recipes.arithmetic.tokenizer import train_tokenizer
from rlstream.models.tiny import build_tokenizer
from rlstream.stages.teacher.tokenizers import Aligner, AlignmentFailed, TokenizerMismatch, make_aligner


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE whose tokens are runs of characters ('abc', ' cba', ...); end of sequence <|im_end|>."""
    return train_tokenizer(["abc cba abcabc 12+3=15", "cba abc bca"] * 20, vocab_size=300)


def test_coarse_student_tokens_are_spelled_by_finer_teacher_tokens(bpe):
    tiny = build_tokenizer()  # one token per character
    aligner = Aligner(bpe, tiny, "bpe", "tiny")
    prompt = bpe("xy>", add_special_tokens=False)["input_ids"]
    response = bpe("abc cba", add_special_tokens=False)["input_ids"] + [bpe.eos_token_id]
    assert [bpe.decode([t]) for t in response[:2]] == ["abc", " cba"]
    al = aligner.align(prompt, response, [1, 0, 1])
    # The teacher's row: its BOS, then x y > a b c ␠ c b a, then its EOS for the student's.
    assert al.teacher_ids == tiny("xy>abc cba", add_special_tokens=True)["input_ids"] + [tiny.eos_token_id]
    assert al.spans == [(4, 7), None, (11, 12)]
    # Each student token's teacher log-prob is its teacher tokens' summed (token i was predicted at i - 1).
    seq = [-0.1 * (i + 1) for i in range(len(al.teacher_ids) - 1)]
    assert al.student_logprobs(seq) == pytest.approx([seq[3] + seq[4] + seq[5], 0.0, seq[10]])


def test_a_student_token_inside_a_teacher_token_fails_with_its_class(bpe):
    tiny = build_tokenizer()
    aligner = Aligner(tiny, bpe, "tiny", "bpe")
    response = tiny("abc", add_special_tokens=False)["input_ids"]
    with pytest.raises(AlignmentFailed) as failed:
        aligner.align(tiny("x>", add_special_tokens=False)["input_ids"], response, [1, 1, 1])
    assert failed.value.failure_class == "split_token"
    # Tokens the student did not act on need no teacher span.
    assert aligner.align([], response, [0, 0, 0]).spans == [None, None, None]


def test_end_of_sequence_inside_the_text_is_not_guessed(bpe):
    aligner = Aligner(bpe, build_tokenizer(), "bpe", "tiny")
    ids = bpe("abc", add_special_tokens=False)["input_ids"]
    with pytest.raises(AlignmentFailed) as failed:
        aligner.align([], ids + [bpe.eos_token_id] + ids, [1] * (2 * len(ids) + 1))
    assert failed.value.failure_class == "special_token"


def test_a_teacher_that_aligns_nothing_is_refused_naming_both(bpe, tmp_path):
    # A teacher that reads any text as one unknown word: no student token is ever spelled by its tokens.
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", eos_token="</s>").save_pretrained(
        tmp_path / "teacher")
    bpe.save_pretrained(tmp_path / "student")
    assert Aligner(bpe, build_tokenizer(), "bpe", "tiny").probe() > 0.5
    with pytest.raises(TokenizerMismatch) as refused:
        make_aligner(tmp_path / "student", tmp_path / "teacher", "policy v0")
    assert str(tmp_path / "teacher") in str(refused.value) and "policy v0" in str(refused.value)

"""Teacher and student tokenizers: the teacher scores the student's own token ids, so it must read them as the
student wrote them. A teacher whose tokenizer differs is refused at start, naming both, rather than producing
log-probs of the wrong tokens.
"""
from __future__ import annotations

from pathlib import Path

from rlstream.errors import UserError
from rlstream.policy.weights import tokenizer_hash


class TokenizerMismatch(UserError):
    """Teacher and student tokenize differently: distillation on token ids would be meaningless."""


def make_aligner(student_folder: Path, teacher_folder: Path, student: str) -> "Aligner":
    """An Aligner of the student's tokenizer (its policy folder) onto the teacher's, or TokenizerMismatch naming
    both when no token of the student's can be spelled by the teacher's."""
    from rlstream.models.loading import load_tokenizer
    aligner = Aligner(load_tokenizer(student_folder, flag="the student's policy folder"),
                      load_tokenizer(teacher_folder, flag="--teacher"), f"{student}, {student_folder}",
                      str(teacher_folder))
    if aligner.probe() == 0:
        raise TokenizerMismatch(f"the teacher's tokenizer ({teacher_folder}) cannot be aligned with the student's "
                                f"({student}, {student_folder}): no token of the student's is spelled by teacher "
                                "tokens; use a teacher with a finer or the same tokenizer")
    return aligner


def check_tokenizers(teacher_folder: Path, student_hash: str, student: str = "the student") -> str:
    """The teacher's tokenizer hash, or TokenizerMismatch naming both tokenizers when it differs from the
    student's (``student``: what to call the student's in the message)."""
    teacher_hash = tokenizer_hash(teacher_folder)
    if student_hash and teacher_hash != student_hash:
        raise TokenizerMismatch(
            f"teacher tokenizer ({teacher_folder}, hash {teacher_hash}) differs from the student's ({student}, "
            f"hash {student_hash}); on-policy distillation on token ids needs the same tokenizer — use a teacher "
            "of the same family, or --align-tokenizers to score the student's tokens through their text")
    return teacher_hash


# -- teachers with another tokenizer: alignment through character offsets -----------------------------------------

#: Why a sample could not be aligned (its feedback's failure class):
#:   split_token: a student token's text starts or ends inside a teacher token (no teacher tokens make it up);
#:   special_token: a special token other than end-of-sequence among the student's action tokens, or an
#:     end-of-sequence the teacher has no token for;
#:   empty_token: an action token whose text is empty;
#:   unstable_decode: the student's text of a token changes once later tokens are decoded with it;
#:   no_context: the first teacher token, which nothing before it predicts (a teacher without a BOS token).
ALIGNMENT_FAILURES = ("split_token", "special_token", "empty_token", "unstable_decode", "no_context")


class AlignmentFailed(Exception):
    """A sample whose tokens cannot be mapped onto the teacher's; ``failure_class`` is one of ALIGNMENT_FAILURES."""

    def __init__(self, failure_class: str, message: str):
        super().__init__(message)
        self.failure_class = failure_class


class Alignment:
    """A sample in the teacher's tokens: its row of teacher ids, and per student response token the teacher
    positions ``[first, last)`` whose tokens spell it (None where the student did not act)."""

    __slots__ = ("teacher_ids", "spans")

    def __init__(self, teacher_ids: list[int], spans: list[tuple[int, int] | None]):
        self.teacher_ids, self.spans = teacher_ids, spans

    def student_logprobs(self, teacher_seq_logprobs: list[float]) -> list[float]:
        """The teacher's log-prob of each student token: the sum over the teacher tokens that spell it (the chain
        rule; teacher token i was predicted at position i - 1)."""
        return [sum(teacher_seq_logprobs[i - 1] for i in range(*span)) if span else 0.0 for span in self.spans]


class Aligner:
    """Maps a student's token ids onto a teacher's tokens through the character offsets of the decoded text.

    A student token is scored when teacher tokens spell exactly its text (its first character starts a teacher
    token, its last ends one): its teacher log-prob is theirs summed. A sample any of whose action tokens is not
    so spelled fails with a failure class rather than a guess. The student's end-of-sequence token maps to the
    teacher's; other special tokens are dropped from the prompt's text.
    """

    def __init__(self, student_tok, teacher_tok, student_name: str, teacher_name: str):
        self.names = (student_name, teacher_name)
        for tok, name in ((student_tok, student_name), (teacher_tok, teacher_name)):
            if not getattr(tok, "is_fast", False):
                raise TokenizerMismatch(f"cannot align the teacher's tokenizer ({teacher_name}) with the student's "
                                        f"({student_name}): {name} is not a fast tokenizer, so it gives no character "
                                        "offsets; use a teacher with the student's tokenizer")
        self.student, self.teacher = student_tok, teacher_tok
        self.student_specials = set(student_tok.all_special_ids)
        self.student_eos, self.teacher_eos = student_tok.eos_token_id, teacher_tok.eos_token_id
        self.teacher_bos = teacher_tok.bos_token_id

    def align(self, prompt_ids: list[int], response_ids: list[int], loss_mask: list[int]) -> Alignment:
        """The sample in the teacher's tokens, or AlignmentFailed."""
        spans, teacher_ids = self._spans(prompt_ids, response_ids, loss_mask)
        for j, span in enumerate(spans):
            if isinstance(span, AlignmentFailed):
                raise span
        return Alignment(teacher_ids, spans)

    def probe(self, n: int = 512) -> float:
        """The share of the student's first ``n`` non-special tokens, decoded one after the other as one text, that
        teacher tokens spell: 0 means the two vocabularies cannot be aligned at all."""
        ids = [i for i in range(min(n + len(self.student_specials), len(self.student)))
               if i not in self.student_specials][:n]
        spans, _ = self._spans([], ids, [1] * len(ids))
        return sum(not isinstance(span, AlignmentFailed) for span in spans) / max(1, len(ids))

    def _spans(self, prompt_ids, response_ids, loss_mask):
        """Per response token its teacher span, None (not acted), or an AlignmentFailed; and the teacher row."""
        n_prompt = len(prompt_ids)
        normal: list[int] = []  # the student's non-special ids so far: their decoded text is the text
        text = ""
        pieces: list[tuple | None] = []  # per response token: (start, end) chars, ("eos", at char), or None
        failures: dict[int, AlignmentFailed] = {}
        for n, tid in enumerate(prompt_ids + list(response_ids)):
            j = n - n_prompt
            acted = j >= 0 and loss_mask[j]
            if tid in self.student_specials:
                if j >= 0:
                    pieces.append(("eos", len(text)) if tid == self.student_eos else None)
                    if acted and tid != self.student_eos:
                        failures[j] = AlignmentFailed("special_token", f"action token {j} is the special token {tid}")
                continue
            normal.append(tid)
            after = self.student.decode(normal, skip_special_tokens=False)
            if not after.startswith(text) and j >= 0 and acted:
                failures[j] = AlignmentFailed("unstable_decode", f"action token {j} changes the text before it")
            start, text = (len(text) if after.startswith(text) else len(after)), after
            if j >= 0:
                pieces.append((start, len(text)))
        enc = self.teacher(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = {s: i for i, (s, e) in reversed(list(enumerate(enc["offset_mapping"]))) if e > s}
        ends = {e: i for i, (s, e) in enumerate(enc["offset_mapping"]) if e > s}
        lead = [self.teacher_bos] if self.teacher_bos is not None else []
        teacher_ids = lead + list(enc["input_ids"])
        spans: list = []
        for j, piece in enumerate(pieces):
            if j in failures or not loss_mask[j]:
                spans.append(failures.get(j))
            elif piece[0] == "eos":
                if self.teacher_eos is None or piece[1] != len(text):
                    spans.append(AlignmentFailed("special_token", f"action token {j} ends the sequence where the "
                                                                  f"teacher ({self.names[1]}) cannot: it has no "
                                                                  "end-of-sequence token, or text follows"))
                    continue
                teacher_ids.append(self.teacher_eos)
                spans.append((len(teacher_ids) - 1, len(teacher_ids)))
            elif piece[0] == piece[1]:
                spans.append(AlignmentFailed("empty_token", f"action token {j} decodes to no text"))
            elif piece[0] in starts and piece[1] in ends and starts[piece[0]] <= ends[piece[1]]:
                first = len(lead) + starts[piece[0]]
                spans.append((first, len(lead) + ends[piece[1]] + 1) if first > 0 else
                             AlignmentFailed("no_context", f"action token {j} is the teacher's first token"))
            else:
                spans.append(AlignmentFailed("split_token", f"action token {j} (characters {piece[0]}-{piece[1]}) "
                                                            "starts or ends inside a teacher token"))
        return spans, teacher_ids

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


def check_tokenizers(teacher_folder: Path, student_hash: str, student: str = "the student") -> str:
    """The teacher's tokenizer hash, or TokenizerMismatch naming both tokenizers when it differs from the
    student's (``student``: what to call the student's in the message)."""
    teacher_hash = tokenizer_hash(teacher_folder)
    if student_hash and teacher_hash != student_hash:
        raise TokenizerMismatch(
            f"teacher tokenizer ({teacher_folder}, hash {teacher_hash}) differs from the student's ({student}, "
            f"hash {student_hash}); on-policy distillation needs the same tokenizer — use a teacher of the same "
            "family")
    return teacher_hash

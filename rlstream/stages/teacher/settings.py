"""The teacher's knobs; no torch here, so the command line stays quick to start."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rlstream.config import knob
from rlstream.engine.settings import DeviceSettings
from rlstream.schemas.records import MAX_TOP_K


@dataclass(frozen=True)
class TeacherSettings(DeviceSettings):
    """The teacher stage's knobs: where its engine runs and how it follows the policy
    (``rlstream.engine.settings``), and these."""

    ROLE: ClassVar[str] = "TEACHER"

    teacher: str = knob("", "Teacher model: a Hugging Face folder or hub id, loaded like --model; '' follows the "
                            "policy itself, reloading on each PolicyVersion")
    teacher_version: str = knob("", "Version label written on feedback ('' = the folder's name; a teacher that "
                                    "follows the policy adds -v<policy version>)")
    top_k: int = knob(0, f"Also send the teacher's k most likely tokens and their log-probs at every student token "
                         f"(k <= {MAX_TOP_K}; 0: the sampled token's log-prob alone)")
    backend: str = knob("transformers", "How the teacher runs: transformers (any temperature, --device), or vllm "
                                        "in process (prompt log-probs; samples drawn at temperature 1 only)",
                        choices=("transformers", "vllm"))
    teacher_url: str = knob("", "A vLLM OpenAI-compatible server to score with instead of loading a model (prompt "
                                "log-probs over token ids; samples drawn at temperature 1 only); its tokenizer must "
                                "be the student's")
    teacher_served_model: str = knob("", "--teacher-url: the model name requests carry ('' = the one it serves)")
    teacher_in_flight: int = knob(32, "--teacher-url: most requests in flight to the server at once")
    align_tokenizers: bool = knob(False, "A teacher with another tokenizer: score each student token by the teacher "
                                         "tokens that spell its text (character offsets; sampled-token feedback "
                                         "only); a sample that cannot be aligned goes on without feedback, status "
                                         "alignment_failed and its failure class")
    timeout_s: float = knob(20.0, "A batch's time budget: samples not scored within it go on without teacher "
                                  "feedback (status timeout); keep it under --handler-timeout-s")
    batch_tokens: int = knob(8192, "Most padded tokens in one teacher forward (a batch is scored in such chunks)")

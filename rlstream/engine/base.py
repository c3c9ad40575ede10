"""The interface every inference backend implements: token ids in, sampled token ids, their log-probs and the
policy version of each token out."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rlstream.schemas.records import SamplingParams


@dataclass
class Generation:
    """One sampled continuation: its tokens, their behaviour log-probs, the version of each, and why it stopped.

    ``versions[i]`` is the policy version whose weights sampled ``token_ids[i]`` (and gave ``logprobs[i]``);
    it changes inside one generation only when weights were swapped between engine steps.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos) or "length"
    versions: list[int] = field(default_factory=list)
    #: version -> wall-clock ms of the engine step that sampled this sequence's first token with it
    version_started_at: dict[int, int] = field(default_factory=dict)


#: Called by a backend between engine steps; it may call the backend's ``load_weights`` (same thread).
BetweenSteps = Callable[[], None]
#: Called by a backend that ``streams`` after every engine step with the generations so far (same order as the
#: prompts; their token_ids grow in place). It must be quick: the engine waits for it.
OnStep = Callable[[list[Generation]], None]


class InferenceBackend(ABC):
    """What rollout (and teacher) need from an engine."""

    name = "backend"
    #: True when ``generate`` calls ``between_steps`` and continues in-flight sequences under swapped weights.
    swaps_mid_generation = False
    #: The policy version of the weights loaded now (-1: unknown); ``load_weights`` sets it.
    version = -1
    #: False for an endpoint whose weights rlstream does not control (a pinned version): the stage does not push.
    follows_policy = True
    #: True when ``generate`` takes ``on_step`` (the gateway streams tokens as they come; others answer whole).
    streams = False
    #: True when ``load_tensors`` takes a version's tensors from memory (an in-process engine: the weights log hands
    #: them over without writing a folder for the engine to read back).
    loads_tensors = False
    #: True when ``load_adapter`` applies a LoRA version's adapter to the base this engine holds.
    serves_adapters = False
    #: Content hash of the base weights this engine holds (set by ``PolicyWeights`` when it builds or loads one): a
    #: LoRA version's adapter is applied only when it names this base (``rlstream.policy.adapters``).
    base_hash = ""

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 between_steps: BetweenSteps | None = None, keys: list[str] | None = None) -> list[Generation]:
        """Sample one continuation per prompt.

        A backend that ``swaps_mid_generation`` calls ``between_steps`` after every engine step; if it
        loaded new weights, the unfinished sequences continue under them and their later tokens carry the
        new version. Other backends ignore it (they swap only between calls).

        ``keys`` (one per prompt, e.g. the episode id) let a backend with several servers send every turn of an
        episode to the server that holds its prefix in cache; a single engine ignores them.
        """

    @abstractmethod
    def load_weights(self, folder: Path, version: int) -> None:
        """Swap in a policy version's weights (between calls to generate, or from ``between_steps``)."""

    def load_tensors(self, tensors: dict, version: int) -> None:
        """Swap in a policy version's weights from its tensors by checkpoint name (when ``loads_tensors``). The
        tensors are the caller's: copied in, not kept."""
        raise NotImplementedError(f"{self.name} loads weights from a folder only")

    def load_adapter(self, folder: Path, version: int) -> None:
        """Serve a LoRA version: its adapter (a PEFT adapter folder) over the base this engine holds."""
        raise NotImplementedError(f"{self.name} cannot serve LoRA adapters")

    @property
    def probe_precise(self) -> bool:
        """Whether this engine computes log-probs in fp32 (the load probe's tighter tolerance then applies)."""
        return False

    def probe_logprobs(self, token_ids: list[int]) -> list[float] | None:
        """The log-prob of each of ``token_ids[1:]`` after the tokens before it, under the weights loaded now
        (the load probe, ``rlstream.policy.probe``); None when this engine cannot say."""
        return None

    def close(self) -> None:
        """Release the engine."""


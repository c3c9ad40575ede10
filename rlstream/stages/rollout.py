"""The rollout stage: prompts and observations in, one model turn per episode out to ``actions``.

Rollout owns tokenization: it tokenizes prompts and the env's observation text,
so environments stay tokenizer-agnostic.

New policy versions go in as soon as they are announced (``--swap step``): a
background thread loads them while the engine is idle, and a generation in
progress loads them itself between two engine steps and carries on under the
new weights (vLLM; AReaL's interruptible generation). Every token's behaviour
log-prob comes from the weights that sampled it. An action turn's
``policy_version`` is the oldest version that produced any of its tokens, so
the staleness filter stays conservative; a turn continued under newer weights
also gets a ``rollout.swap.v<N>`` stamp in ``stage_times`` (when version N took
over), and every action turn records its version segments (``run_lengths``: which
version sampled which of its tokens), for the trainer's ``--stale-rule token``.
``--swap batch`` loads only between batches.

Eval-lane prompts (``eval-prompts``, ``records.is_eval``) are served ahead of any
backlog: while some wait on this worker's partitions, prompts and observations are
paused (``before_poll``) in up to ``--eval-share`` of the polls, and both are served
in the rest.

How the runtime drives it (``batched``): on an in-process engine (transformers,
vllm) one batch per transaction, generated as one engine batch (batching is the
engine's whole point); on a server fleet (vllm-server, sglang, openai) pipelined,
one record at a time (``handle``: a task's G samples, or one observation's next
turn), records in flight across polls and each committed as it finishes, so a
server that is done takes the next record's requests instead of idling until the
batch's slowest request ends. The fleet serializes pushes against requests and
stamps each reply with the version its server confirmed, so no engine lock is held
around a pipelined generation.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar

from rlstream import metrics
from rlstream.config import LoopSettings, knob
from rlstream.errors import UserError
from rlstream.models.loading import ModelError, chat_prompt_ids, chat_turn_ids, context_limit, load_tokenizer
from rlstream.policy.staleness import rollout_should_pause
from rlstream.policy.weights import PolicyWeights
from rlstream.runtime.stage import Incoming, InvalidRecord, Output, Stage, StageContext
from rlstream.schemas.headers import now_ms
from rlstream.schemas.records import Episode, Failure, SamplingParams, Task, Turn, episode_key, is_eval
from rlstream.engine import Generation
from rlstream.engine.follower import PolicyFollower
from rlstream.engine.settings import EngineSettings, build_backend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutSettings(EngineSettings):
    """The rollout stage's knobs: the engine's (``rlstream.engine.settings``), and these."""

    ROLE: ClassVar[str] = "ROLLOUT"

    engine_version: int = knob(-1, "Backend openai: the policy version its tokens are stamped with (the operator "
                                   "pins it; -1: the first announced version)")
    allow_unversioned: bool = knob(False, "Let the openai backend (no weight push, pinned version) feed training")
    max_new_tokens: int = knob(0, "Most new tokens per turn: a task asking for more is cut to this "
                                  "(0: as the task asks)")
    eval_share: float = knob(0.5, "While eval-lane prompts wait, the most share of this worker's polls they go "
                                  "first in (training prompts paused); the rest serve both (1: always first)")
    generation_timeout_s: float = knob(600.0, "In-process engine: the least seconds a batch's generation may run "
                                              "(per 8 prompts) before its records are dead-lettered as "
                                              "handler_timeout; the runtime's --handler-timeout-s is for quick "
                                              "handlers")
    swap: str = knob("step", "When new weights go in: step (as soon as announced; between engine steps of a "
                             "generation in progress where the backend can, vLLM) or batch (only between batches)",
                     choices=("step", "batch"))

#: Prefix of the stage_times stamp a turn gets when newer weights took over during it (``rollout.swap.v<N>``).
SWAP_STAMP = "rollout.swap.v"


def run_lengths(versions: list[int]) -> tuple[list[int], list[int]]:
    """A turn's version segments from the engine's version of each token: (versions, token counts), one per run.

    A backend that swaps weights between engine steps (in-process vLLM) reports each token's version, so a turn
    spanning a swap gets two segments; one that swaps only between calls gives one version for the whole turn."""
    out_v: list[int] = []
    out_n: list[int] = []
    for v in versions:
        if out_v and out_v[-1] == v:
            out_n[-1] += 1
        else:
            out_v.append(v)
            out_n.append(1)
    return out_v, out_n


class RolloutStage(Stage):
    """Generates the next action turn of every episode: a batch at a time on an in-process engine, a record at a
    time (pipelined) on a server fleet."""

    name = "rollout"
    # eval-prompts is the eval lane (records.is_eval): served ahead of any backlog of the other two (before_poll).
    inputs = ("eval-prompts", "prompts", "observations")
    # Prompts come from outside the loop; a source may not know any policy version yet.
    require_policy_version = False

    def __init__(self, settings: RolloutSettings = RolloutSettings(), loop: LoopSettings = LoopSettings()):
        self.loop = loop
        if not 0 < settings.eval_share <= 1:
            raise ValueError(f"--eval-share {settings.eval_share}: must be in (0, 1], a share of the polls")
        self.settings = settings
        self.backend = None
        self.max_context = settings.max_context  # 0 until the first version's folder says the model's own
        # Each version's local folder, checked against its hash: from the store, or rebuilt from the weights log
        # under this worker's own home (it may share no path with the trainer).
        self.follower = PolicyFollower(self.name, loop.policy, PolicyWeights(loop.home_path / "weights-cache"),
                                       settings.retry_load_s)
        # An in-process engine is used by one thread at a time: the batch handler (a pool thread), the swapper thread
        # and before_poll (the main thread). A handler that outlived its timeout still holds it. Pipelined handlers
        # (a fleet) do not take it: the fleet itself keeps pushes and requests apart.
        self._engine_lock = threading.Lock()
        # Pipelined handlers run in many threads; HF tokenizers are not safe to call from several at once.
        self._tokenizer_lock = threading.Lock()
        self._eval_polls = (0, 0)  # (polls the eval lane went first in, polls it waited through)
        self._stop = threading.Event()
        self._swapper: threading.Thread | None = None

    @property
    def version(self) -> int:
        """The policy version the engine holds, as it confirmed it."""
        return self.follower.version

    # -- how the runtime drives it --------------------------------------------------------

    @property
    def batched(self) -> bool:
        """One batch per transaction on an in-process engine; pipelined per record on a server fleet."""
        return not self.settings.remote

    @property
    def handler_timeout_s(self) -> float | None:
        """A pipelined record's handler outlives the fleet's own bound on its requests: waiting for a server (a push
        in progress included) until ``request_timeout_s``, then each of its ``request_retries + 1`` attempts up to
        ``request_timeout_s``. So the fleet, which retries and fails over, decides that a request failed; the
        generic ``--handler-timeout-s`` never dead-letters a slow but healthy generation. An in-process engine's
        batch gets ``--generation-timeout-s``: under the generic 30 s, the smollm2 recipe on one CPU core
        dead-lettered healthy generations of 8 samples of 96 tokens."""
        s = self.settings
        if self.batched:
            return s.generation_timeout_s
        return s.request_timeout_s * (s.request_retries + 2) + 1.0

    @property
    def max_in_flight(self) -> int | None:
        """Pipelined on a fleet whose servers take at most ``--max-concurrency`` requests each: as many records as
        the servers have request slots. Every record has at least one request, so the servers stay full; the rest of
        the backlog waits in Kafka, where the eval lane's pause (``before_poll``) holds it back. Unlimited servers:
        the runtime's ``--max-in-flight``. Either way the runtime's ``--concurrency`` (64) bounds the records
        generating at once: past 64 request slots with one sample a record, raise it to the slots."""
        if self.batched or self.settings.max_concurrency <= 0:
            return None
        return self.settings.max_concurrency * max(1, len(self.settings.urls()))

    # -- policy following (rlstream.engine.follower: one rule for every engine) ----------

    def _ensure_started(self, ctx: StageContext) -> None:
        if self.backend is not None:
            return
        self.follower.connect(ctx.kafka.client_config(), ctx.kafka.run)
        log.info("rollout waiting for the first %s policy version", self.loop.policy)
        folders = []

        def build(pv, folder):
            folders.append(folder)
            self.max_context = self.settings.max_context or context_limit(folder)
            return self._make_backend(folder, pv.version)
        self.backend = self.follower.start(self.settings.wait_policy_s, build)
        self.tokenizer = getattr(self.backend, "tokenizer", None) or load_tokenizer(folders[0], flag="policy folder")
        if self.settings.swap == "step":
            self._start_swapper()

    def _start_swapper(self) -> None:
        """The thread that loads each announced version while the engine is idle (``PolicyFollower.follow``)."""
        self._swapper = threading.Thread(target=self.follower.follow, name="rollout-swap", daemon=True,
                                         args=(self._engine_lock, self._stop, self.backend))
        self._swapper.start()

    def _make_backend(self, folder, version: int):
        """The engine, holding ``version`` (the weights in ``folder``); server backends are checked and pushed it."""
        s = self.settings
        if s.backend == "openai":
            if not s.allow_unversioned:
                raise UserError("--backend openai cannot load the trainer's weights, so its tokens would carry a "
                                "version no server confirmed; give --allow-unversioned to train on it anyway "
                                "(tokens carry --engine-version), or use --backend vllm-server / sglang")
            version = s.engine_version if s.engine_version >= 0 else version
        tokenizer = load_tokenizer(folder, flag="policy folder") if s.remote else None
        return build_backend(s, folder, version, self.max_context, tokenizer, api_key_env="RLSTREAM_ROLLOUT_API_KEY")

    def _swap_to_latest(self) -> bool:
        """Load the newest announced version if it is newer than the engine's; True if it loaded one.

        The caller holds the engine lock. Called between batches, by the swapper thread while the engine
        is idle, and by the backend between engine steps of a generation in progress.
        """
        return self.follower.swap(self.backend)

    def _between_steps(self) -> None:
        """The backend's hook between engine steps: new weights, if any, go in now (the lock is ours)."""
        self._swap_to_latest()

    def prepare(self, ctx: StageContext) -> None:
        # A standby's in-process engine loads the newest version (and, with --swap step, follows). A server fleet's
        # client costs nothing to start, and a standby must not push versions to servers its primary drives.
        if not self.settings.remote:
            self._ensure_started(ctx)

    def before_poll(self, ctx: StageContext) -> None:
        self._ensure_started(ctx)
        # Without a swapper this is where versions go in; with one, this only catches what it has not yet.
        if self._engine_lock.acquire(blocking=False):
            try:
                self._swap_to_latest()
            finally:
                self._engine_lock.release()
        # The eval lane first: while eval prompts wait on this worker's partitions, training prompts and episodes in
        # flight wait (pausing drops what was prefetched of them, so the next batch is the eval prompts), but only in
        # --eval-share of those polls: a large held-out set on the only worker once held the trainer idle for minutes.
        evals_waiting = False
        if ctx.backlog("eval-prompts") > 0:
            first, waited = self._eval_polls
            evals_waiting = eval_goes_first(first, waited, self.settings.eval_share)
            self._eval_polls = (first + evals_waiting, waited + 1)
        # AReaL's rule: do not start new episodes that will only be thrown away as stale (eval results are not
        # trained on, so the rule does not hold them back). A pinned endpoint never catches up; pausing for it would
        # stop the stage for good.
        following = getattr(self.backend, "follows_policy", True)
        stale = following and rollout_should_pause(self.follower.watcher.version, self.version, self.loop.eta)
        for topic, pause in (("prompts", stale or evals_waiting), ("observations", evals_waiting)):
            if pause:
                ctx.pause(topic)
            elif ctx.is_paused(topic):
                ctx.resume(topic)

    # -- generation ------------------------------------------------------------------------

    def handle(self, item: Incoming) -> list[Output]:
        """One record's episodes (pipelined, on a server fleet): a task's G samples or an observation's next turn."""
        [result] = self._generate([item], pipelined=True)
        if isinstance(result, Exception):
            raise result  # InvalidRecord: dead-lettered with why
        return result

    def handle_batch(self, items: list[Incoming]) -> list[list[Output] | Exception]:
        return self._generate(items, pipelined=False)

    def _generate(self, items: list[Incoming], pipelined: bool) -> list[list[Output] | Exception]:
        """The next turn of every episode of ``items``, one backend call per distinct sampling. Batched, the call
        holds the engine (and takes a version announced since before_poll first); pipelined, it leaves pushes to the
        swapper and the fleet, which never pushes to a server with requests in flight."""
        results: list[list[Output] | Exception] = [[] for _ in items]
        by_params: dict[tuple, list[tuple[int, Episode]]] = defaultdict(list)
        for idx, item in enumerate(items):
            try:
                with self._tokenizer_lock:
                    episodes = (self._start_episodes(item.record, item.topic == "eval-prompts")
                                if item.topic != "observations" else [self._with_observation(item.record)])
            except (InvalidRecord, ModelError) as exc:
                results[idx] = InvalidRecord(str(exc))  # this record alone is dead-lettered, with why
                continue
            for ep in episodes:
                params = self._sampling(ep)
                if params.max_tokens <= 0:
                    context = len(ep.task.prompt_token_ids) + len(ep.token_ids)
                    ep.failure = Failure("context_exhausted", f"the episode's {context} tokens leave no room for a "
                                         f"new turn (max_context {self.max_context})", self.name)
                    ep.done = True
                    results[idx].append(self._output(ep))
                    continue
                by_params[(params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed)].append(
                    (idx, ep))
        for key, group in by_params.items():
            params = SamplingParams(temperature=key[0], top_p=key[1], top_k=key[2], max_tokens=key[3], seed=key[4])
            prompts = [ep.task.prompt_token_ids + ep.token_ids for _, ep in group]
            keys = [ep.episode_id for _, ep in group]
            if pipelined:
                # The fleet stamps each reply with the version its server confirmed; started_version only labels a
                # reply with no tokens.
                started, started_version = now_ms(), self.version
                gens = self.backend.generate(prompts, params, keys=keys)
                finished = now_ms()
            else:
                step = self.settings.swap == "step"
                with self._engine_lock:
                    if step:
                        self._swap_to_latest()  # announced since before_poll: start on it rather than one batch late
                    started, started_version = now_ms(), self.version
                    gens = self.backend.generate(prompts, params, between_steps=self._between_steps if step else None,
                                                 keys=keys)
                    finished = now_ms()
            metrics.GENERATED_TOKENS.labels(self.backend.name).inc(sum(len(g.token_ids) for g in gens))
            for (idx, ep), gen in zip(group, gens):
                self._append_turn(ep, gen, started, finished, started_version)
                results[idx].append(self._output(ep))
        return results

    def _sampling(self, ep: Episode) -> SamplingParams:
        """This turn's sampling: the task's, its new tokens cut to --max-new-tokens and to the context left."""
        s = ep.task.sampling
        room = self.max_context - len(ep.task.prompt_token_ids) - len(ep.token_ids)
        wanted = min(s.max_tokens, self.settings.max_new_tokens or s.max_tokens)
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              max_tokens=min(wanted, room), seed=s.seed)

    def _append_turn(self, ep: Episode, gen: Generation, started: int, finished: int, started_version: int) -> None:
        """Add one generation to an episode as an action turn, versioned by the oldest weights in it."""
        start = len(ep.token_ids)
        ep.token_ids += gen.token_ids
        ep.loss_mask += [1] * len(gen.token_ids)
        ep.behaviour_logprobs += gen.logprobs
        # Conservative for the staleness filter: the turn is as old as its oldest token.
        version = min(gen.versions, default=started_version)
        for v, at in sorted(gen.version_started_at.items()):
            if v > version:
                ep.stage_times[f"{SWAP_STAMP}{v}"] = at  # when newer weights took this turn over
        with self._tokenizer_lock:
            text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        seg_versions, seg_tokens = run_lengths(gen.versions or [started_version] * len(gen.token_ids))
        ep.turns.append(Turn("action", text, start, len(ep.token_ids), policy_version=version,
                             finish_reason=gen.finish_reason, started_at=started, finished_at=finished,
                             segment_versions=seg_versions, segment_tokens=seg_tokens))
        ep.stage_times.setdefault("rollout.start", started)
        ep.stage_times["rollout.end"] = finished

    def _start_episodes(self, task: Task, eval_lane: bool = False) -> list[Episode]:
        """The G episodes of a task, its prompt tokenized once: through the chat template for chat messages.

        A task read from eval-prompts stays in the eval lane downstream: marked ``eval`` if it says ``train``.
        InvalidRecord when the prompt cannot fit the context with room for one new token.
        """
        if eval_lane and not is_eval(task):
            task.split = "eval"
        if not task.prompt_token_ids:
            if task.metadata.get("messages"):
                task.prompt_token_ids = chat_prompt_ids(self.tokenizer, json.loads(task.metadata["messages"]))
            else:
                task.prompt_token_ids = self.tokenizer(task.prompt)["input_ids"]
        if len(task.prompt_token_ids) >= self.max_context:
            raise InvalidRecord(f"prompt of {len(task.prompt_token_ids)} tokens does not fit max_context "
                                f"{self.max_context} with room for a response (task asks {task.sampling.max_tokens} "
                                "new tokens); raise the rollout's --max-context or shorten the prompt")
        return [Episode(episode_id=f"{task.group_id}:{i}", group_id=task.group_id, sample_index=i, task=task,
                        stage_times={"prompt.created": task.created_at}, trace_id=task.trace_id)
                for i in range(max(1, task.group_size))]

    def _with_observation(self, ep: Episode) -> Episode:
        """Append the env's observation as context tokens: a chat episode's through the template, as a message of
        ``metadata['observation_role']`` (default ``user``) followed by the next generation prompt."""
        turn = ep.turns[-1]
        if turn.role == "observation" and turn.token_end == turn.token_start and turn.text:
            if ep.task.metadata.get("messages"):
                role = ep.task.metadata.get("observation_role", "user")
                ids = chat_turn_ids(self.tokenizer, [{"role": role, "content": turn.text}])
            else:
                ids = self.tokenizer(turn.text, add_special_tokens=False)["input_ids"]
            turn.token_start = len(ep.token_ids)
            ep.token_ids += ids
            ep.loss_mask += [0] * len(ids)  # environment tokens are context, never trained on
            ep.behaviour_logprobs += [0.0] * len(ids)
            turn.token_end = len(ep.token_ids)
        return ep

    def _output(self, ep: Episode) -> Output:
        versions = [t.policy_version for t in ep.turns if t.role == "action"]
        return Output("actions", episode_key(ep), ep, policy_version=min(versions) if versions else self.version)

    def close(self) -> None:
        self._stop.set()
        if self._swapper is not None:
            self._swapper.join(5)
        self.follower.close()
        if self.backend is not None:
            self.backend.close()


def eval_goes_first(first: int, waited: int, share: float) -> bool:
    """Whether the eval lane goes first in the next poll it waits through, having gone first in ``first`` of the
    ``waited`` before: while that keeps its share of them at most ``share`` (the first poll always)."""
    return first < share * (waited + 1)

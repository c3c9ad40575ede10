"""The trainer process: windowed-FIFO consumption, staleness filter, updates, and versioned publish.

A training step is a transaction: the version's folder is written to the weight store
first (its weights every version, the optimizer state every ``--checkpoint-every``:
``trainer/checkpoint.py``), then the PolicyVersion record and the offsets of the samples used are
committed together. A crash in between redoes the step; no version is announced
whose samples were not consumed, and a restart resumes from the last announced one. A transaction the broker
aborts is tried again with the same outputs before the process exits to redo the step (``trainer/announce.py``).

The window trains complete groups out of log order, so a committed offset stops at the oldest sample still held;
what was trained (or evicted) past it is listed in the offset's metadata, committed in the same transaction
(``kafka.inflight``'s done-ahead map, as the pipelined stages keep theirs), and a trainer that reads the partition
again skips it. Kept in Kafka, it reaches a trainer on any host.

With ``--weights-transport kafka`` the version's weights also go on the run's weights topic
(``rlstream.policy.weight_log``; produced while the folder is still being written, the PolicyVersion only once it
is there): the chunks outside the transaction, before anything is produced in it, and the manifest that names
them inside it, so a version of any size becomes visible with its PolicyVersion or not at all; either way the
PolicyVersion carries the content hash every worker checks its load against.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rlstream import metrics
from rlstream.config import KafkaSettings, LoopSettings
from rlstream.policy.probe import trainer_probe
from rlstream.errors import RestartToResume, UserError
from rlstream.kafka import records
from rlstream.kafka.group import GroupMember
from rlstream.kafka.inflight import committed_done_ahead, done_ahead_offsets
from rlstream.kafka.records import Rejected
from rlstream.kafka.topics import topic_name
from rlstream.kafka.transactions import TransactionalProducer
from rlstream.models.devices import (cpu_has_bf16, enable_gradient_checkpointing, resolve_device,
                                     resolve_threads)
from rlstream.models.loading import (flash_attn_installed, load_tokenizer, resolve_attention, set_attention,
                                     torch_dtype)
from rlstream.models.resources import ModelShape
from rlstream.models.logprobs import check_packing
from rlstream.policy.watcher import last_policy_version
from rlstream.policy.weight_log import WeightLogWriter
from rlstream.policy.weights import PolicyWeights, WeightStore, tokenizer_hash
from rlstream.runtime import lifecycle
from rlstream.runtime.settings import RuntimeSettings
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion
from rlstream.trainer.announce import announce, in_log
from rlstream.trainer.chain import chain_stats
from rlstream.trainer import shards
from rlstream.trainer.checkpoint import PendingVersion, VersionWriter, load_resumed
from rlstream.trainer.distill import DistillConfig, coef_at
from rlstream.trainer.distributed import Ranks, check_ranks, start_ranks
from rlstream.trainer.sharding import make_engine
from rlstream.trainer.gate import OutcomeBooks, SampleGate, trajectory_of
from rlstream.trainer.initial import version_zero
from rlstream.trainer.lora import BaseReference, LoraTraining
from rlstream.trainer import meta
from rlstream.trainer.microbatch import train_step, trainer_budget
from rlstream.trainer.precision import resolve_precision
from rlstream.trainer.settings import TrainerSettings
from rlstream.trainer.update import UpdateConfig, build_batch
from rlstream.trainer.warm import stand_by, warm
from rlstream.trainer.window import WindowedFIFO, WindowItem

log = logging.getLogger(__name__)

class TrainerService:
    """``rlstream run trainer``: consumes scored samples and publishes policy versions."""

    def __init__(self, settings: TrainerSettings = TrainerSettings(), loop: LoopSettings = LoopSettings()):
        self.loop = loop
        if loop.groups_per_step > settings.window_groups:
            raise ValueError("--groups-per-step cannot exceed --window-groups: a batch comes from inside the window")
        if not 0 < settings.weights_chunk_mb <= 15:
            raise ValueError("--weights-chunk-mb must be in (0, 15]: a weights record must fit the 16 MiB message limit")
        if not 0 < settings.gpu_memory_fraction <= 1:
            raise ValueError("--gpu-memory-fraction must be in (0, 1]: a share of the GPU's memory")
        if settings.checkpoint_every < 1:
            raise ValueError("--checkpoint-every must be at least 1 (1: the optimizer state with every version)")
        self.launched = check_ranks(settings.nproc, settings.device, settings.threads)  # torchrun's or srun's
        self.settings = settings
        self.ranks = Ranks()  # this process's rank; set by the launcher on several ranks
        self.device: torch.device | None = None  # with the knobs that follow it: _place
        self.attention: str | None = None  # --attn-implementation resolved (None: transformers' choice)
        self.ref_model = None  # the KL reference (_load_ref)
        self.store = WeightStore(settings.weights)
        self.evicted = 0
        self._counted = (0, 0, 0)  # (accepted, stale, stale tokens) at the last publish, for per-step counts
        # What became of each consumed position since the last publish, published with the offsets that cover it:
        # summed over every version, trained + refused + evicted + skipped = the records the group committed.
        self._books = OutcomeBooks()
        self.version = -1
        self._stopping = False
        self._letters: list = []  # (message, reason, error) to dead-letter in the next transaction
        # Positions trained (or evicted) beyond the committed offsets before this consumer read them (their metadata).
        self._done_ahead: set[tuple[str, int, int]] = set()
        self._commit_s: float | None = None  # the last announcing transaction's seconds
        self._writer: VersionWriter | None = None  # built at the first publish, once the model is
        # Where a version's folder is written while its weights already go into the transaction (PendingVersion).
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="publish-write")
        self._tokenizer_hash: str | None = None  # the same for every version this process writes
        self._full_checkpoint: int | None = None  # the newest announced version with the optimizer state
        self._resuming = -1  # the announced version a restarted trainer resumes
        self._member: GroupMember | None = None  # joined once version 0 is there (serve)
        distill = DistillConfig(settings.opd_kl, settings.opd_kl_mix, settings.opd_zero_outside_topk)
        self.update_cfg = UpdateConfig(loss=settings.loss, clip_eps=settings.clip_eps, is_cap=settings.is_cap,
                                       kl_coef=settings.kl_coef, distill=distill,
                                       packed=settings.packed_sequences)
        if settings.loss != "ppo" and settings.source != "feedback":
            raise ValueError(f"--loss {settings.loss} needs the teacher's feedback: add --source feedback and run "
                             "the teacher stage (rlstream run teacher)")
        self.lora = LoraTraining(settings, loop.eta) if settings.lora_rank else None  # --lora-rank: trainer/lora.py
        self.gate = SampleGate(settings, loop.eta, distill)
        self.counter = self.gate.counter  # the staleness counts each step publishes

    # -- lifecycle -------------------------------------------------------------------

    def serve(self, kafka: KafkaSettings, runtime: RuntimeSettings = RuntimeSettings()) -> None:
        """Train until ``stop()`` (the process lifecycle calls it on SIGTERM/SIGINT) or max_steps; every step ends in
        a committed transaction."""
        if self.ranks.world == 1 and start_ranks(self.settings.nproc, self.launched, serve_rank,
                                                 (self.settings, self.loop, kafka, runtime), self.settings.device):
            return  # the ranks ran serve_rank
        torch.set_num_threads(resolve_threads(self.settings.threads))
        self.kafka = kafka
        self.group_id = f"{kafka.run}.trainer"
        if runtime.standby:  # warm: imported and placed; what it resumes is read once the primary is gone
            self._line = stand_by(self, kafka, runtime)
            if self._line is None:
                return
        # The policy is the trainer's identity: a restarted trainer fences its predecessor here, aborting any
        # half-done step, and commits through the same transactional producer as every stage.
        self.txn = TransactionalProducer(kafka, f"{kafka.run}.trainer.{self.loop.policy}", who="trainer",
                                         transaction_timeout_ms=runtime.transaction_timeout_ms,
                                         stopping=lambda: self._stopping)
        self.txn.start()
        self.window = WindowedFIFO(self.settings.window_groups, self.settings.head_timeout_s)
        self._lag = metrics.LagProbe("trainer", kafka.run)
        self.weight_log = WeightLogWriter(kafka.run, self.loop.policy, self.settings.weights_anchor_every,
                                          int(self.settings.weights_chunk_mb * 1024 * 1024)) \
            if self.settings.weights_transport == "kafka" else None
        self._load_or_create()
        # One trainer per policy: the policy is its stable identity, so a restart rejoins without a rebalance.
        self._member = GroupMember(kafka, self.group_id, [topic_name(kafka.run, self.settings.source)],
                                   instance=self.loop.policy, session_timeout_ms=runtime.session_timeout_ms,
                                   on_revoke=lambda c, parts: self.window.clear(),
                                   on_assign=self._assigned, who="trainer").subscribe()
        steps = 0
        try:
            while not self._stopping:
                self._consume_once(runtime)
                evicted = sum(len(g.items) for g in self.window.evict_expired())
                self.evicted += evicted
                self._books.evicted += evicted
                metrics.EVICTED_SAMPLES.labels("trainer").inc(evicted)
                while self.window.complete_in_window() >= self.loop.groups_per_step and not self._stopping:
                    self._step(self.window.take(max_groups=self.loop.groups_per_step))
                    steps += 1
                    if self.settings.max_steps and steps >= self.settings.max_steps:
                        self._stopping = True
        finally:
            self._member.close()

    @property
    def consumer(self):
        """The group member's current consumer (a new object after it was replaced)."""
        return self._member.consumer

    # -- resume / create -------------------------------------------------------------

    def _assigned(self, consumer, parts) -> None:
        """Partitions (re)assigned: read again from their committed offsets, skipping what was trained past them."""
        self.window.clear()
        self._books = OutcomeBooks()  # what was decided and not committed is read and decided again
        self._done_ahead = committed_done_ahead(consumer, parts)

    def _place(self) -> None:
        """This rank's device, and the knobs whose defaults follow it (``--dtype``, ``--autocast``,
        ``--publish-dtype``: ``trainer/precision.py``; ``--attn-implementation``), resolved once, before any load."""
        if self.device is not None:
            return
        s = self.settings
        self.device = resolve_device(s.device, self.ranks.local_rank)
        cuda = self.device.type == "cuda"
        precision = resolve_precision(self.device.type, s.dtype, s.autocast, s.publish_dtype,
                                      bf16_supported=cuda and torch.cuda.is_bf16_supported())
        self.attention = resolve_attention(s.attn_implementation, self.device.type,
                                           cuda and flash_attn_installed(), s.packed_sequences)
        self.settings = dataclasses.replace(s, dtype=precision.dtype, autocast=precision.autocast,
                                            publish_dtype=precision.publish_dtype)
        if cuda and 0 < s.gpu_memory_fraction < 1:
            # The trainer's share of a GPU it shares (infra/placement.py): torch's allocator stays within it.
            torch.cuda.set_per_process_memory_fraction(s.gpu_memory_fraction, self.device)
        if not cuda and precision.autocast == "bf16" and not cpu_has_bf16():
            log.warning("--autocast bf16 on a CPU without bf16 instructions (AVX512-BF16, AMX or Arm BF16): torch "
                        "emulates them, and a step is slower than in float32; --autocast off is faster here")
        log.info("trainer on %s: dtype %s, autocast %s, publish %s, attention %s", self.device, precision.dtype,
                 precision.autocast, precision.publish_dtype, self.attention or "transformers' default")

    def _load_or_create(self) -> None:
        self._place()
        announced = last_policy_version(self.kafka.client_config(), self.kafka.run, self.loop.policy)
        if announced is not None:
            self._resuming = announced.version  # _build takes the newest optimizer state at or before it
            if self.lora:
                self.lora.announced(announced)
            self._build(self.ranks.broadcast(self._resume_folder(announced)))
            self.version = announced.version
            log.info("trainer resumed %s at v%d", self.loop.policy, self.version)
        else:
            self._build(self.ranks.broadcast(None))
            self._publish(0, {"warmup_steps": float(self.settings.warmup_steps)}, offsets=None, samples=0)
        ref = None
        if self.settings.kl_coef > 0 and self.lora is None:  # LoRA's reference is its own base (_load_ref)
            if 0 not in self.store.versions(self.loop.policy):
                raise UserError(f"--kl-coef: the KL reference, {self.loop.policy} v0, is not in the store "
                                f"{self.settings.weights!r}: point --weights at the store that holds it")
            ref = self.store.fetch(self.loop.policy, 0, self.loop.home_path / "weights-cache")
            self.ranks.command("ref", ref)
        self._load_ref(ref)

    def _build(self, folder: Path | None) -> None:
        """This rank's model, tokenizer and engine: the checkpoint in ``folder`` with its optimizer state, or
        version 0. Every rank runs it (rank 0 names the folder); the engine starts every rank from rank 0's weights,
        so the warm-up runs on rank 0 alone."""
        self._place()
        if folder is not None:
            self.tokenizer = load_tokenizer(folder, flag="resume from")
            self.model = self.lora.resumed(folder, self.loop.home_path / "weights-cache") if self.lora else \
                meta.resumed_model(folder, self.settings.dtype, self.settings.sharding, self.device)
        else:
            self.model, self.tokenizer = version_zero(self.settings, self.attention, self.ranks.lead, self.lora,
                                                      self.store, self.loop.policy)
        self.engine = self._engine(folder)
        found = shards.find(folder, self.store, self.loop.policy, self._resuming, self.loop.home_path /
                            "weights-cache") if folder is not None and self.ranks.lead else None
        found = self.ranks.broadcast(found)  # where each rank reads its own shard, and what wrote it
        if found:
            shards.load(self.engine, *found, self.settings.sharding, self.ranks.world)
        self.model.eval()

    def _resume_folder(self, announced: PolicyVersion) -> Path:
        """The announced version's folder: from the trainer's own store (with its optimizer state), else, on a host
        without it, from where workers load it (the weights log, or the store it names), hash-checked; the optimizer
        state then starts anew (it travels with neither)."""
        policy, cache = self.loop.policy, self.loop.home_path / "weights-cache"
        if announced.version in self.store.versions(policy):
            return self.store.fetch(policy, announced.version, cache)
        try:
            folder = PolicyWeights(cache, self.kafka.client_config(), self.kafka.run).folder(announced)
        except (OSError, ValueError) as exc:
            raise UserError(f"trainer: {policy} v{announced.version} is announced in run {self.kafka.run!r} but is "
                            f"not in the store {self.settings.weights!r} nor loadable from {announced.weights_uri} "
                            f"({exc}). Point --weights at the store that holds it, or start a new --run") from None
        log.warning("resuming %s at v%d from %s: not in this trainer's store, so the optimizer state starts anew%s",
                    policy, announced.version, announced.weights_uri,
                    "" if self.settings.publish_dtype == "auto" else
                    f" and the weights are the published {self.settings.publish_dtype} ones, not the master")
        return folder

    def _load_ref(self, folder: Path | None) -> None:
        """The KL reference (version 0), on this rank's device; None without --kl-coef. LoRA: the policy's own
        forward with its adapter disabled (the frozen base), no second model."""
        if self.lora and self.settings.kl_coef > 0:
            self.ref_model = BaseReference(self.engine)
            return
        self.ref_model = None if folder is None else \
            load_resumed(folder, self.settings.dtype, flag="--kl-coef reference").to(self.engine.device).eval()

    def _engine(self, folder: Path | None):
        s = self.settings
        if s.packed_sequences:
            check_packing(self.model)
        if s.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        set_attention(self.model, self.attention)
        # Its shape read before the engine (ZeRO-3 leaves each rank a shard of the parameters).
        # The default micro-batch budget is sized from it on any device (a ZeRO-3 model's parameters counted whole).
        shape = dataclasses.replace(ModelShape.of_model(self.model), params=meta.param_count(self.model))
        engine = make_engine(self.model, s.lr, self.update_cfg.max_grad_norm, s.sharding,
                             device=self.device, autocast_mode=s.autocast,
                             world_size=self.ranks.world, lr_warmup_steps=s.lr_warmup_steps, weights=folder)
        self.model = engine.model
        self.budget = trainer_budget(s, self.device, shape, engine.sharded, self.ranks.world)
        return engine

    # -- consuming -------------------------------------------------------------------

    def stop(self) -> None:
        """Finish the current step and return from serve()."""
        self._stopping = True

    def _consume_once(self, runtime: RuntimeSettings) -> None:
        # Wakes on the first record and takes only what is fetched already (GroupMember.consume): no step waits
        # out a poll timeout for a batch that will not fill.
        for m in self._member.consume(runtime.batch_size, runtime.poll_timeout_s):
            position = (m.topic(), m.partition(), m.offset())
            if self._done_ahead and position in self._done_ahead:
                self.window.skip(position)  # trained before the restart: counted by the version that committed it
                continue
            try:
                item = records.decode(m, self.settings.source)
            except Rejected as rej:
                self._letters.append((m, rej.reason, str(rej)))
                # Consumed with its letter: the transaction that writes the letter also commits past it.
                self.window.skip(position)
                self._books.skipped += 1
                continue
            sample = item.record
            decision = self.gate.decide(sample, item.headers, item.policy_version, self.version)
            if decision.letter:
                self._letters.append((m, *decision.letter))
            traj = trajectory_of(sample)
            if decision.action == "add":
                self.window.add(WindowItem(traj.group_id, traj.task.group_size, position, time.monotonic(), sample))
            elif decision.action == "refuse":
                self.window.refuse(traj.group_id, traj.task.group_size, position)
                self._books.refused += 1
            else:  # skip, ignore: done with, in no group (another reward version's records are consumed past too)
                self.window.skip(position)
                self._books.skipped += 1
        self._lag.maybe_update(self.consumer, self.consumer.assignment)

    # -- one step --------------------------------------------------------------------

    def _step(self, groups) -> None:
        started, started_ms = time.monotonic(), hdr.now_ms()
        batch = build_batch([[it.payload for it in g.items] for g in groups], self.settings.advantage,
                            self.tokenizer.pad_token_id)  # load_tokenizer gave a pad-less tokenizer eos as pad
        s = self.settings
        batch.opd_coef = coef_at(self.version, s.opd_coef, s.opd_coef_end, s.opd_coef_versions)
        self.ranks.command("step", batch)
        stats = self._train(batch)
        stats["train_s"] = time.monotonic() - started
        if self._commit_s is not None:
            stats["commit_s"] = self._commit_s  # the previous version's transaction
        stats.update(chain_stats((trajectory_of(it.payload).stage_times for g in groups for it in g.items), started_ms))
        stats.update({"step_seconds": time.monotonic() - started, "stale": float(self.counter.stale),
                      "accepted": float(self.counter.accepted), "stale_ratio": self.counter.stale_ratio,
                      "evicted": float(self.evicted)})
        # Per-step counts as well: the cumulative ones restart with the process, these add up across restarts.
        (accepted, stale, tokens), self._counted = self._counted, (self.counter.accepted, self.counter.stale,
                                                                   self.counter.stale_tokens)
        stats.update({"accepted_step": float(self.counter.accepted - accepted),
                      "stale_step": float(self.counter.stale - stale),
                      "stale_tokens": float(self.counter.stale_tokens),
                      "stale_tokens_step": float(self.counter.stale_tokens - tokens)})
        stats.update(self._books.take())
        self._publish(self.version + 1, stats, offsets=self.window.committable_offsets(),
                      samples=int(batch.input_ids.shape[0]))
        metrics.STEP_SECONDS.labels("trainer").observe(time.monotonic() - started)

    def _train(self, batch) -> dict[str, float]:
        """This rank's part of one step on ``batch`` (every rank holds all of it)."""
        return train_step(self.engine, batch, self.update_cfg, self.ref_model, self.budget, self.ranks.rank,
                          self.ranks.world)

    def _checkpoint_parts(self, staging: str | None, stream: bool = False):
        """The whole model's parameters on rank 0 where the engine shards them (else None; ``stream``: written a
        tensor at a time into rank 0's folder, ``meta.stream_full``), and with ``staging`` the training state's
        manifest, each rank's shard written there (``trainer/shards.py``); every rank takes part."""
        into = self.loop.home_path / "publish-stream" if self.ranks.lead else None
        full = meta.stream_full(self.model, into, self._writer.publish_dtype if into else None) if stream else \
            self.engine.full_state_dict()
        return full, shards.save(self.engine, staging, self.settings.sharding, self.ranks.world) if staging else None

    def _publish(self, version: int, stats: dict[str, float], offsets, samples: int) -> None:
        policy = self.loop.policy
        publish_started, created = time.monotonic(), hdr.now_ms()  # the update is done: the version exists
        written = {}
        every = 1 if self.engine.sharded else self.settings.checkpoint_every
        full_checkpoint = self._full_checkpoint is None or version % every == 0
        staging = shards.staging(self.store, policy, version) if full_checkpoint else None
        if self._writer is None and self.lora:
            self._writer = self.lora.writer(self.model, self.tokenizer)
        if self._writer is None:
            self._writer = VersionWriter(self.model, self.tokenizer, None if self.settings.publish_dtype == "auto"
                                         else torch_dtype(self.settings.publish_dtype))
        # The weights log needs a version's tensors in memory; the store alone takes them streamed.
        stream = self.engine.streams and self.weight_log is None
        self.ranks.command("save", (staging, stream))
        full_state, manifest = self._checkpoint_parts(staging, stream)

        def write(folder: Path, on_content) -> None:
            # What workers load, hashed as they will hash it (the store may be remote: hashed while it is here).
            def hand_over(content, digest) -> None:
                if self.weight_log is not None:
                    self.weight_log.prepare(content, version)
                on_content(content, digest)
            written["content"], written["digest"] = self._writer.write(
                folder, full_state, fast=self.settings.checkpoint_every > 1, on_content=hand_over)
            if self._tokenizer_hash is None:
                self._tokenizer_hash = tokenizer_hash(folder)
            if full_checkpoint:
                shards.adopt(staging, folder, manifest)

        pending = PendingVersion(self._writes, self.store, policy, version, write)
        # The load probe every engine must reproduce for this version (rlstream.policy.probe), while the folder is
        # written (both only read the weights; the next step waits for the folder); a sharded model has no whole
        # copy on this rank to run it on, so its versions go unprobed.
        probe_ids, probe_lps = ([], []) if self.engine.sharded else trainer_probe(self.model)
        if self.weight_log is None:
            pending.uri()  # nothing to send before the folder is there: the transaction stays short
        clock = {"committing": time.monotonic()}
        letters = self._pop_letters()
        # The samples this version was trained on are consumed in the same transaction, those past each offset in
        # its metadata (version 0 is announced before the trainer joins its group: no samples, no offsets).
        points, left_out = done_ahead_offsets(offsets or {}, self.window.released_ahead() if offsets else ())
        if left_out:
            log.warning("%d samples trained past the held head do not fit the offsets' metadata: a restart would "
                        "train them again (a smaller --head-timeout-s or --window-groups keeps it short)", left_out)

        def body():
            weights_uri = None
            if self.weight_log is not None:
                # The chunks first, outside the transaction (its timer has not started: nothing is in it yet), then
                # their manifest in it: visible with their PolicyVersion or not at all. They need only the content
                # and its hash, so they go while the folder's files are still being written.
                content, digest = pending.content()
                weights_uri = self.weight_log.produce(self.txn, content, digest, version)
            # The checkpoint exists before the record that announces it.
            uri = pending.uri()
            clock["committing"] = time.monotonic()
            stats["weights_s"] = clock["committing"] - publish_started
            record = PolicyVersion(policy=policy, version=version, weights_uri=weights_uri or uri,
                                   created_at=created, published_at=hdr.now_ms(), step=version,
                                   parent_version=self.version, samples_trained=samples, metrics=stats,
                                   trainer_id=self.group_id, tokenizer_hash=self._tokenizer_hash,
                                   content_hash=written["digest"], probe_token_ids=probe_ids,
                                   probe_logprobs=probe_lps, **(self.lora.fields() if self.lora else {}))
            records.produce(self.txn, self.kafka.run, "policy-versions", policy, record, version)
            for m, reason, error in letters:
                self.txn.dead_letter("trainer", m, reason, error)
            return points
        committed, rejoined = announce(self.txn, self._member, body, {(t, p) for t, p, _, _ in points},
                                       f"trainer v{version}", in_log(self.kafka, policy, version))
        if rejoined:  # a new consumer, read ahead anywhere: back to what is committed now (trainer/announce.py)
            self._member.seek_committed()
            self._assigned(self.consumer, self.consumer.assignment())
        if not committed:
            # The model has moved on past what the log says: exit, and a restart resumes from the last announced
            # version and the committed offsets (the step is redone).
            raise RestartToResume(f"trainer: the transaction announcing v{version} was aborted (the log above says "
                                  f"why); a restart resumes from v{self.version} and trains its samples again")
        self.version = version
        if full_checkpoint:
            self._full_checkpoint = version
        # Known only once committed: the next version carries it.
        self._commit_s = time.monotonic() - clock["committing"]
        metrics.PUBLISH_SECONDS.observe(time.monotonic() - publish_started)
        metrics.POLICY_VERSION.labels("trainer").set(version)
        # Versions older than η + 1 behind can no longer be needed by a rollout worker.
        keep_from = version - self.loop.eta - 1
        # The newest optimizer state stays until a newer one is announced: a restart resumes Adam from it.
        self.store.prune(policy, keep_from=keep_from, keep={0, self._full_checkpoint},
                         keep_every=self.settings.keep_every)
        if self.weight_log is not None:
            self.weight_log.committed()
            self.weight_log.truncate(self.kafka.client_config(), keep_from)
        log.info("published %s v%d %s", policy, version,
                 " ".join(f"{k}={v:.3g}" for k, v in stats.items() if k in ("reward_mean", "loss", "stale_ratio",
                                                                           "step_seconds")))

    def _pop_letters(self):
        letters, self._letters = self._letters, []
        return letters


def serve_rank(ranks: Ranks, settings: TrainerSettings, loop: LoopSettings, kafka: KafkaSettings,
               runtime: RuntimeSettings) -> None:
    """One rank of ``--nproc N`` or a launcher's: rank 0 is the trainer, the others follow its commands
    (trainer/distributed.py)."""
    torch.set_num_threads(resolve_threads(settings.threads, share=ranks.local_world))
    service = TrainerService(settings, loop)
    service.ranks = ranks
    if not ranks.lead:
        if runtime.standby:
            warm(service)
        ranks.follow(service)
        return
    # Rank 0 stops on the signals its launcher forwards, as a trainer of one rank does (runtime/lifecycle.py).
    forget = lifecycle.process().configure("trainer rank 0", runtime.stop_timeout_s).on_stop(service.stop)
    try:
        service.serve(kafka, runtime)
    finally:
        forget()
    ranks.command("stop")

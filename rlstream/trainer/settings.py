"""The trainer's knobs (``rlstream run trainer --help``): every field is a flag and an environment variable."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rlstream.config import knob
from rlstream.models.loading import ATTENTION
from rlstream.trainer.distill import LOSSES
from rlstream.trainer.sharding import SHARDING


@dataclass(frozen=True)
class TrainerSettings:
    """The trainer's knobs (defaults train the demo's tiny model)."""

    ROLE: ClassVar[str] = "TRAINER"

    weights: str = knob(".rlstream/weights", "Weight store URI: a local path or file://, or an fsspec URL shared "
                                             "with other hosts (s3://, gs://)")
    weights_transport: str = knob("store", "How workers get each version: store (the URI of its folder in "
                                           "--weights) or kafka (anchors and deltas on the run's weights topic, "
                                           "for workers that share no path with the trainer)",
                                  choices=("store", "kafka"))
    weights_anchor_every: int = knob(10, "--weights-transport kafka: a full anchor every K versions (version 0 and "
                                         "a restarted trainer's first are anchors too), deltas in between")
    weights_chunk_mb: float = knob(8.0, "--weights-transport kafka: payload per weights record, in MiB (below the "
                                        "topics' 16 MiB message limit)")
    checkpoint_every: int = knob(10, "Write the optimizer state (what a restarted trainer resumes Adam from) with "
                                     "every Kth version, the others only what workers load; a restart takes the "
                                     "newest at or before its version (1: every version, through save_pretrained "
                                     "as before this knob). ZeRO and FSDP2 write it every version")
    keep_every: int = knob(0, "Keep every Nth version in the store for audit and reproducibility, beyond the "
                              "versions η needs (0: none)")
    source: str = knob("rewards", "Topic to train from: rewards, or feedback (teacher log-probs)",
                       choices=("rewards", "feedback"))
    reward_version: str = knob("", "Train only on this reward version ('' = any)")
    model: str = knob("tiny", "The policy's version 0, as given: a Hugging Face folder (config, safetensors, "
                              "tokenizer) or a hub id where a hub is reachable; tiny: the demo's built-in model")
    dtype: str = knob("auto", "Parameter dtype of the trained model: auto (on CUDA fp32 master weights, whatever the "
                              "checkpoint's dtype: a bf16 weight loses AdamW's small updates; on the CPU the "
                              "checkpoint's own), bf16, fp16, fp32", choices=("auto", "bf16", "fp16", "fp32"))
    publish_dtype: str = knob("auto", "Dtype of the published weights workers load: auto (bf16 on CUDA under bf16 "
                                      "autocast, else as trained), bf16, fp16, "
                                      "fp32; another than the trained one keeps the master weights, as trained, "
                                      "private in the trainer's store for its resume (train fp32, publish bf16: "
                                      "the weights log's deltas stay small)", choices=("auto", "bf16", "fp16", "fp32"))
    chat_template: str = knob("", "A Jinja chat template file, set on the model's tokenizer and saved with every "
                                  "version (for a model folder that has none)")
    task: str = knob("reverse", "Built-in task of the supervised warm-up (--warmup-steps)")
    stale_rule: str = knob("sample", "How the eta bound applies: sample (drop a sample whose oldest token is more "
                                     "than eta versions old) or token (mask out only the tokens older than eta, by "
                                     "each turn's version segments; drop the sample when none is left)",
                           choices=("sample", "token"))
    window_groups: int = knob(32, "Windowed FIFO size W in groups")
    head_timeout_s: float = knob(120.0, "Evict (and record) an incomplete head group older than this")
    advantage: str = knob("grpo", "Advantage estimator: grpo, dr_grpo, rloo, reinforce_pp")
    loss: str = knob("ppo", "ppo (decoupled PPO-clip), opd (on-policy distillation alone), ppo+opd (PPO on the "
                            "per-token advantage A_t - λ·KL_t, as slime does) or ppo+opd-sum (PPO loss + λ·KL loss); "
                            "the opd ones need --source feedback", choices=LOSSES)
    opd_kl: str = knob("reverse", "Distillation KL: reverse KL(student||teacher), forward KL(teacher||student), or "
                                  "mixed", choices=("reverse", "forward", "mixed"))
    opd_kl_mix: float = knob(0.5, "--opd-kl mixed: the forward KL's weight (the reverse KL's is 1 minus it)")
    opd_zero_outside_topk: bool = knob(False, "Top-k feedback: the teacher is zero outside its k tokens and the "
                                              "student keeps its whole vocabulary (default: both renormalised over "
                                              "the k tokens)")
    opd_coef: float = knob(1.0, "λ, the teacher's weight in ppo+opd and ppo+opd-sum (at version 0 with a schedule)")
    opd_coef_end: float = knob(-1.0, "λ at --opd-coef-versions and after, reached linearly (<0: λ is constant)")
    opd_coef_versions: int = knob(0, "Versions over which λ goes from --opd-coef to --opd-coef-end (0: constant)")
    opd_reverse_eta: int = knob(-1, "Staleness bound of reverse (and mixed) KL on sampled-token feedback, which "
                                    "assumes the current student drew the token; at most η (-1: η). Forward KL and "
                                    "top-k feedback keep η")
    teacher_version: str = knob("", "Train only on feedback of this teacher version ('' = any)")
    lr: float = knob(1e-4, "AdamW learning rate (2e-4 collapsed the tiny model to zero reward here)")
    lr_warmup_steps: int = knob(0, "Linear learning-rate warm-up over this many updates (0: full --lr from the "
                                   "first); a pretrained model's first Adam steps are otherwise full-size")
    clip_eps: float = knob(0.2, "PPO clip range")
    is_cap: float = knob(5.0, "Truncation of the behaviour importance weight")
    kl_coef: float = knob(0.0, "KL-to-reference coefficient (0 disables the reference model)")
    warmup_steps: int = knob(0, "Supervised warm-up steps on --task before version 0 (0: none, version 0 is the model "
                                 "as given; the demo asks 300 for the random tiny model); steps, not seconds, so a "
                                 "busy machine gets the same starting policy")
    warmup_fraction: float = knob(0.005, "Fraction of training pairs used by the warm-up")
    max_steps: int = knob(0, "Stop after this many updates (0 = run until stopped)")
    threads: int = knob(0, "Torch threads for this process (0: OMP_NUM_THREADS when set, as the demo's placement "
                           "sets it, else this process's cores divided among --nproc ranks)")
    sharding: str = knob("none", "How the --nproc ranks share the training state: none (DDP: everything on every "
                                 "rank), zero1, zero2, zero3 (DeepSpeed ZeRO at that stage) or fsdp2 (torch "
                                 "fully_shard); CPU ranks run each over gloo", choices=SHARDING)
    nproc: int = knob(1, "Trainer ranks (torch.distributed: gloo on the CPU, NCCL on GPUs); rank 0 reads, commits "
                         "and publishes, every rank trains its share of each step")
    device: str = knob("auto", "Where each rank trains: auto (its CUDA device when CUDA is present, else the CPU), "
                               "cpu, cuda, or cuda:N (one rank)")
    autocast: str = knob("auto", "Forward under torch.autocast: auto (bf16 on a CUDA device that has it, off on "
                                 "the CPU), bf16 or off; parameters keep --dtype, and ZeRO's DeepSpeed config gets a "
                                 "bf16 block", choices=("auto", "off", "bf16"))
    gpu_memory_fraction: float = knob(1.0, "On CUDA: the share of its GPU's memory this trainer may take (torch's "
                                           "per-process memory fraction; the demo's placement sets it when rollout "
                                           "shares the GPU); the default micro-batch budget is sized within it")
    attn_implementation: str = knob("auto", "Attention kernel: auto (flash_attention_2 for --packed-sequences on "
                                            "CUDA when flash-attn is installed, its variable-length path; else "
                                            "transformers' choice, sdpa), sdpa, flash_attention_2, eager",
                                    choices=ATTENTION)
    gradient_checkpointing: bool = knob(False, "Recompute activations in the backward instead of keeping them")
    micro_batch_tokens: int = knob(-1, "Split each step into micro-batches of at most this many padded tokens, "
                                       "gradients accumulated into one optimizer step (0: the whole batch at once, "
                                       "refused on a GPU when it cannot fit; -1: a budget sized from the memory left "
                                       "(the GPU's on CUDA, the machine's available memory on the CPU) and the "
                                       "model's hidden size, layers and vocabulary)")
    packed_sequences: bool = knob(False, "Padding-free: each (micro-)batch's rows packed into one sequence, attention "
                                         "kept within each row (models whose masks follow position_ids, checked at "
                                         "start); --micro-batch-tokens then counts real tokens")
    lora_rank: int = knob(0, "LoRA through PEFT: train a rank-R adapter on the frozen base (in --dtype) and publish "
                             "only the adapter, its base named by content hash (0: train the whole model); with "
                             "--sharding none (plain torch, or DDP over --nproc ranks)")
    lora_alpha: float = knob(16.0, "--lora-rank: the adapter's scale is alpha / rank")
    lora_dropout: float = knob(0.0, "--lora-rank: dropout on the adapter's input while training")
    lora_target_modules: tuple[str, ...] = knob(("all-linear",), "--lora-rank: the linear modules that get an "
                                                                  "adapter, by short name (q_proj, v_proj, ...; "
                                                                  "repeatable or comma-separated), or all-linear "
                                                                  "(every linear layer but the output head)")
    seed: int = knob(0, "Seed of the initial model and warm-up")

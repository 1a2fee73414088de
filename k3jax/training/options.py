"""Training options (`train.py`'s flags as one frozen dataclass, validated on construction) and the context
curriculum's stages. Kept apart from the loop (`k3jax.training.trainer`) so tools that only describe a run (the
compile-only path, export, benchmarks) read them without the loop."""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from k3jax.training.optimizer import lr_schedule


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    workdir: str | None = None  # checkpoints + metrics.jsonl; None: nothing is written
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    learning_rate: float = 3e-3
    warmup_fraction: float = 0.01
    weight_decay: float = 0.1
    optimizer: str = "muon"  # "muon" (per-head Muon + AdamW) or "adamw"
    max_grad_norm: float | None = 1.0
    quantile_balancing: bool = True
    mtp: bool = True
    mtp_weight: float = 0.3
    data: str | None = None  # prepared data dir (python -m k3jax.data.prepare); None: the embedded corpus
    seed: int = 0
    log_every: int = 20
    checkpoint_every: int = 100  # also saved at the end and on SIGTERM
    keep_checkpoints: int = 3
    resume: bool = True
    mesh: str | None = None  # "data,expert,context,model"; None or "auto": the config's plan (sharding/plan.py)
    halt_at_step: int | None = None  # stop (and save) after this step, as a preemption would
    context_stages: tuple[tuple[int, int], ...] = ()  # ((after_step, seq_len), ...): the context curriculum
    init_from: str | None = None  # a k3jax checkpoint (python -m k3jax.convert) to start from instead of random init
    grad_accum: int = 1  # micro-batches per optimizer step (batch_size rows split into grad_accum micro-batches)
    muon_ns_dtype: str = "float32"  # Newton–Schulz matmul operands: "float32" or "bfloat16" (f32 accumulation)
    state_dtype: str = "float32"  # optimizer state (momentum, AdamW moments): "float32" or "bfloat16"
    eval_every: int = 0  # held-out LM loss every N steps and after the last one (k3jax/training/evaluate.py); 0: none
    eval_batches: int = 10  # batches per evaluation (of batch_size / grad_accum rows)
    eval_data: str | None = None  # prepared eval data dir; None: the held-out split of the training data
    vision_config: str | None = None  # multimodal: a named vision tower (configs/vision.py); data from
    max_patches: int = 1024  # `prepare_multimodal`; image patches per row (k3jax/training/multimodal.py)

    def __post_init__(self):
        if self.optimizer not in ("muon", "adamw"):
            raise ValueError(f"optimizer must be 'muon' or 'adamw', got {self.optimizer!r}")
        if self.grad_accum < 1 or self.batch_size % self.grad_accum:
            raise ValueError(f"grad_accum must be >= 1 and divide batch_size={self.batch_size}, "
                             f"got {self.grad_accum}")
        for name in ("steps", "batch_size", "seq_len", "log_every", "keep_checkpoints", "max_patches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {self.state_dtype!r}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ValueError(f"eval_every must be >= 0 and eval_batches >= 1, got eval_every={self.eval_every} "
                             f"eval_batches={self.eval_batches}")
        if self.eval_data is not None and not self.eval_every:
            raise ValueError("eval_data is read only with eval_every > 0 (evaluate every N steps)")
        if self.vision_config is not None and (self.eval_every or self.data is None):
            raise ValueError("--vision_config needs --data (a `python -m k3jax.data.prepare_multimodal` directory) "
                             "and has no held-out eval yet (--eval_every 0)")

    @property
    def train_split(self) -> str:
        """The document split training reads: "train" (without the held-out documents) when the eval reads the
        held-out split of the training data, else "all"."""
        return "train" if self.eval_every and self.eval_data is None else "all"

    def schedule(self) -> optax.Schedule:
        """The learning rate by step: 1% linear warmup, then cosine decay over `steps`."""
        return lr_schedule(self.learning_rate, self.steps, warmup_fraction=self.warmup_fraction)

    def resume_keys(self) -> dict[str, Any]:
        """Options a resumed run must share with the checkpoint (the rest may change, e.g. --steps)."""
        return {k: getattr(self, k) for k in ("batch_size", "seq_len", "optimizer", "quantile_balancing", "mtp",
                                              "data", "seed", "context_stages", "train_split", "vision_config",
                                              "max_patches")}


STATE_DTYPES = ("float32", "bfloat16")


def parse_context_stages(text: str | None) -> tuple[tuple[int, int], ...]:
    """'1000:65536,5000:262144' -> ((1000, 65536), (5000, 262144)): after step 1000 sequences are 65536 long, ...
    (before the first stage, --seq_len). NoPE: nothing positional changes, only the packing length."""
    if not text:
        return ()
    stages = []
    for part in text.split(","):
        try:
            after, length = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"context stage {part!r} is not AFTER_STEP:SEQ_LEN (in {text!r})") from None
        if after < 0 or length < 1:
            raise ValueError(f"context stage {part!r}: step must be >= 0 and seq_len >= 1")
        stages.append((after, length))
    if [a for a, _ in stages] != sorted({a for a, _ in stages}):
        raise ValueError(f"context stages must have increasing steps: {text!r}")
    return tuple(stages)


def stage_at(opts: TrainOptions, step: int) -> tuple[int, int]:
    """(stage index, seq_len) used by training step `step` (1-based); stage 0 is --seq_len."""
    index, length = 0, opts.seq_len
    for j, (after, stage_len) in enumerate(opts.context_stages, start=1):
        if step > after:
            index, length = j, stage_len
    return index, length

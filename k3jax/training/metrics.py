"""Training throughput accounting (model FLOPs, MFU) and the JSONL metrics log in the workdir."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import jax

from k3jax.config import ModelConfig

# Dense bf16 peak per device, FLOP/s, by `device_kind` substring (vendor figures, no sparsity).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v6": 918e12,
    "TPU7x": 2307e12,
}


def format_duration(seconds: float) -> str:
    """'42s', '3m05s', '2h07m': a progress line's remaining time."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def peak_flops_per_device(device: jax.Device | None = None) -> float | None:
    """The device's dense bf16 peak (FLOP/s), or None when unknown (e.g. CPU): MFU is then not reported."""
    kind = (device or jax.devices()[0]).device_kind
    for key, value in PEAK_BF16_FLOPS.items():
        if key.lower() in kind.lower():
            return value
    return None


def model_flops_per_token(cfg: ModelConfig, seq_len: int, *, active_params: int, mtp: bool = False) -> float:
    """Training FLOPs per token (forward + backward = 3× forward).

    Matmuls: 2·active parameters per token forward (active = every non-routed weight a token touches plus its k
    routed experts and the head). Attention over the sequence, which parameters do not count: MLA causal
    QKᵀ and AV average T/2 keys, 2·H·(d_qk + d_v)·T/2 per token; KDA's chunked form (C = 64)
    10·C·d + 6·d² + (2/3)·C² per head and token (docs/kernels.md#kda-chunk). The MTP block adds one MLA+FFN
    layer's worth (approximated by one more attention term; its weights are in `active_params` if counted there).
    """
    n_mla = len(cfg.full_attn_layers) + (1 if mtp else 0)
    n_kda = cfg.num_hidden_layers - len(cfg.full_attn_layers)
    d_qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    mla = n_mla * 2 * cfg.num_attention_heads * (d_qk + cfg.v_head_dim) * seq_len / 2
    c, d = cfg.runtime.kda_chunk_size, cfg.kda_head_dim
    kda = n_kda * cfg.kda_num_heads * (10 * c * d + 6 * d * d + (2 / 3) * c * c)
    return 3.0 * (2.0 * active_params + mla + kda)


class MetricsLog:
    """Appends one JSON object per logged step to `<workdir>/metrics.jsonl` (a no-op without a workdir).

    `resumed_step`: the step a run starts after (0: a fresh run). Rows of later steps, which the previous run wrote
    after its last checkpoint and this run writes again, are dropped first (the file is rewritten atomically), so
    the log holds one row per step across resumes."""

    def __init__(self, workdir: str | None, resumed_step: int | None = None):
        self.path = os.path.join(workdir, "metrics.jsonl") if workdir else None
        if self.path:
            os.makedirs(workdir, exist_ok=True)
            if resumed_step is not None and os.path.exists(self.path):
                self._truncate_after(resumed_step)

    def _truncate_after(self, step: int) -> None:
        with open(self.path) as f:
            lines = f.readlines()
        keep = [line for line in lines if _row_step(line) <= step]
        if len(keep) == len(lines):
            return
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(line if line.endswith("\n") else line + "\n" for line in keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def write(self, step: int, values: dict[str, Any]) -> None:
        if not self.path:
            return
        row = {"step": step, "time": time.time()}
        for k, v in values.items():
            v = float(v) if hasattr(v, "__float__") else v
            row[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _row_step(line: str) -> float:
    """A row's step; a line that does not parse (a write cut short) counts as past every step (dropped)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf

"""ModelConfig: the one description of a K3-family model, validated on construction.

Everything structural (which layers are KDA or MLA, dense or MoE, where AttnRes takes block snapshots, how layers
group into scanned units) is derived here from the released config fields, so no other module re-derives it.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from typing import Any, Literal, Mapping

import jax.numpy as jnp

AttnKind = Literal["kda", "mla"]
FfnKind = Literal["dense", "moe"]

_EXPERT_PARALLEL_PATTERN = re.compile(r"^(auto|dropless|off|capacity(:[0-9]*\.?[0-9]+(e[-+]?[0-9]+)?)?)$")
_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16, "float64": jnp.float64}


class ConfigError(ValueError):
    """A config field is missing, unknown or out of range. The message names the field."""


def parse_kernel_tiling(name: str, text: str) -> tuple[int, int, int, int] | None:
    """"tk-tn-warps-stages" -> (tk, tn, warps, stages), "" -> None (the kernel's default); tk, tn and warps
    powers of two, stages >= 1. `name`: the config field, for the error."""
    if not text:
        return None
    parts = text.split("-")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"{name} must be 'tk-tn-warps-stages' (four positive integers) or '', got {text!r}")
    tk, tn, warps, stages = (int(p) for p in parts)
    if any(v < 1 or v & (v - 1) for v in (tk, tn, warps)) or tk < 16 or tn < 16 or stages < 1:
        raise ConfigError(f"{name}: tk and tn must be powers of two >= 16, warps a power of two, stages >= 1; "
                          f"got {text!r}")
    return tk, tn, warps, stages


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer is made of."""

    index: int  # 0-based layer index
    attn: AttnKind
    ffn: FfnKind


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """A run of layers executed together: `num_repeats` copies of the `pattern` unit, scanned when > 1."""

    start: int  # first 0-based layer index
    pattern: tuple[tuple[AttnKind, FfnKind], ...]
    num_repeats: int

    @property
    def num_layers(self) -> int:
        return len(self.pattern) * self.num_repeats


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Text backbone of Kimi K3 and its relatives. Field names follow the released config where one exists."""

    name: str = "custom"
    # --- trunk
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    full_attn_layers: tuple[int, ...] = tuple(range(4, 93, 4)) + (93,)  # 1-based, as in the released config
    first_k_dense_replace: int = 1
    intermediate_size: int = 33792  # dense MLP width (layer 0)
    hidden_act: Literal["situ", "silu"] = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    initializer_range: float = 0.02
    # --- KDA
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_short_conv_kernel_size: int = 4
    kda_gate: Literal["lower_bound", "softplus"] = "lower_bound"
    kda_gate_lower_bound: float = -5.0
    kda_output_gate: Literal["full_rank", "low_rank"] = "full_rank"
    kda_chunk_size: int = 64
    # "auto": the Pallas kernel on GPU/TPU when the gate is the K3 lower-bounded one (>= -5, the kernel's f32
    # range) and head dims are powers of two >= 16, else the pure-JAX chunked path; "pallas" forces the kernel (the
    # Pallas interpreter on CPU: exact but slow, for debugging).
    kda_impl: Literal["auto", "chunked", "recurrent", "pallas"] = "auto"
    # MLA absorbed decode step (one token per sequence): "auto" = the paged Pallas kernel
    # (pallas_kernels/mla: pages read once through the page table) on GPU without a multi-device mesh, else "xla"
    # (gather every sequence's pages, then einsums); "pallas" forces the kernel (the Pallas interpreter off GPU:
    # exact but slow, for tests). Under a multi-device mesh the XLA path always runs.
    mla_decode_impl: Literal["auto", "xla", "pallas"] = "auto"
    # Page ranges per sequence of that kernel (flash-decoding splits; pallas_kernels/mla DecodeConfig.num_splits):
    # 0 = auto (about 128 programs in all: 2 at batch 64), capped at the pages a sequence holds.
    mla_decode_splits: int = 0
    # KDA one-token decode on the Pallas decode kernel (GPU, kda_impl resolving to "pallas"): "prologue" also runs
    # the short conv, SiLU, L2 norms and the gate / beta activations inside it (pallas_kernels/kda/decode_fused.py:
    # one launch instead of ~8 small XLA kernels; k3_gpu decode B = 64 2% faster, benchmarks/RESULTS.md);
    # "prologue_output" (default) also applies the layer's output RMSNorm and sigmoid gate in the kernel (one
    # program per head: block_v = the head dim), so only o_proj follows it (one kernel less per layer: 0.974-0.993x
    # the B = 64 step, 2026-12-02); "step" hands the kernel q/k/v/g/beta activated by XLA. TPU and CPU decode in XLA.
    kda_decode_fusion: Literal["step", "prologue", "prologue_output"] = "prologue_output"
    # Value columns per program of that fused decode kernel (a power of two >= 16; capped at the head dim; the head
    # dim under "prologue_output"). 32: the 2026-11-30 sweep's best; 128 measured the same in the model (2026-12-01).
    kda_decode_block_v: int = 32
    # Warps per program of that kernel (a power of two). At block_v 128 with 4 warps it sits at 255 registers per
    # thread, 2 programs per SM (Nsight Compute, RESULTS.md 2026-12-02); 8 is the untimed alternative.
    kda_decode_warps: int = 4
    # Rows per tile of those decode-sized grouped matmuls (a power of two >= 16): an expert with more rows than one
    # tile streams its weights once per tile; 32 trades that for MMA rows wasted on emptier experts. GPU only.
    moe_decode_row_tile: int = 16
    # Routed experts of decode steps on the GPU kernels (one token per sequence, <= 256 tokens, bf16/f32 weights,
    # one program): "planned" (the expert-sorted row plan, then the grouped GLU and down matmuls), "assigned"
    # (pallas_kernels/moe/assigned.py: two kernels read the router's top-k ids directly, no plan, no row gather) or
    # "auto" (default: "assigned" up to `assigned.AUTO_MAX_ROWS_PER_EXPERT` rows per expert on average, i.e. k3_gpu
    # B <= 128: 0.94x the step time at B = 16, 0.96x at 64, 0.98x at 128, but 1.07x at 256; RESULTS.md, sessions
    # 14-15). TPU and XLA paths ignore it.
    moe_decode_experts: Literal["auto", "planned", "assigned"] = "auto"
    # Programs per (expert, column tile) of the "assigned" kernels: split s walks row tiles s, s + splits, ...
    # (k3_gpu B = 64: 1 / 2 / 4 splits 0.988 / 0.968 / 0.959x the planned step time).
    moe_assigned_splits: int = 4
    # Load tiles of those two kernels, "tk-tn-warps-stages" each (tk / tn powers of two; "" = the kernels' default,
    # pallas_kernels.moe.assigned.ASSIGNED_TILING: 64-128-4-4), for the GLU (gate + up) and the down kernel.
    moe_assigned_glu_tiling: str = ""
    moe_assigned_down_tiling: str = ""
    # Launch order of those kernels after the splits: "expert" (default: the programs in flight stream many experts'
    # same column tile) or "column" (one expert's column tiles side by side: whole weight rows in flight).
    moe_assigned_order: Literal["expert", "column"] = "expert"
    # Expert selection of those plan-free decode steps: "kernel" (default: pallas_kernels/moe/select.py: the
    # router's sigmoid, biased top-k, weights and renormalisation in one launch; k3_gpu B = 16 / 64: 0.99-1.00x the
    # step time, RESULTS.md, 2026-12-02)
    # or "xla" (`route`'s sigmoid, top-k sort, gather and division).
    moe_decode_select: Literal["xla", "kernel"] = "kernel"
    # Decode steps per iteration of the serving decode loop (`lax.scan(unroll=)` in the scheduler's `_decode`): >1
    # puts several steps into one loop body (one CUDA graph launch on a GPU), at that many times the decode compile
    # time. 2 (default): k3_gpu B = 64 0.964 / 0.969x the step time of 1 (two processes, RESULTS.md, 2026-12-02).
    decode_loop_unroll: int = 2
    # --- MLA
    num_attention_heads: int = 96
    q_lora_rank: int | None = 1536  # None: plain q_proj (Kimi-Linear)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # never rotated (NoPE), still attended and cached
    v_head_dim: int = 128
    mla_use_output_gate: bool = True
    mla_lora_norm_eps: float = 1e-6
    # --- MoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584  # latent width L; None: experts act on the full width D
    latent_moe_use_norm: bool = True
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    moe_impl: Literal["dropless", "dense"] = "dropless"
    # expert parallelism under a mesh with expert axis > 1 (sharding/expert_parallel.py): 'auto' (= dropless there),
    # 'dropless' (ragged all-to-all), 'capacity' / 'capacity:<factor>' (static all-to-all, drops counted), 'off'
    moe_expert_parallel: str = "auto"
    # how the routed experts are held: 'bf16' (parameters in param_dtype, trainable) or 'mxfp4' (inference only:
    # E2M1 nibbles + E8M0 scales as uint8, 4.25 bits per weight, decoded inside the grouped matmul)
    expert_weights: Literal["bf16", "mxfp4"] = "bf16"
    # --- Block Attention Residuals
    attn_res_block_size: int | None = 12  # None: plain residual stream (Kimi-Linear)
    # --- MTP
    num_nextn_predict_layers: int = 0
    # --- training-time state
    # MoE layers record this step's routing-margin histogram and expert loads (Quantile Balancing and the training
    # metrics read them; train.py turns this on)
    record_routing_stats: bool = False
    routing_histogram_bins: int = 256
    # --- numerics and compilation
    param_dtype: str = "bfloat16"
    dtype: str = "bfloat16"
    scan_layers: bool = True
    remat: bool = True
    max_position_embeddings: int = 1048576

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        if isinstance(self.full_attn_layers, list):
            object.__setattr__(self, "full_attn_layers", tuple(self.full_attn_layers))
        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "kda_num_heads", "kda_head_dim",
            "kda_short_conv_kernel_size", "kda_chunk_size", "num_attention_heads", "kv_lora_rank",
            "kda_decode_block_v", "qk_nope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
            "moe_intermediate_size", "num_expert_group", "topk_group", "max_position_embeddings",
            "routing_histogram_bins",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ["q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size"]:
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{name} must be > 0 or None, got {v}")
        for name in ["qk_rope_head_dim", "num_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers",
                     "mla_decode_splits"]:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ["rms_norm_eps", "mla_lora_norm_eps", "activation_situ_beta", "activation_situ_linear_beta",
                     "routed_scaling_factor", "initializer_range"]:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.kda_gate_lower_bound < 0:
            raise ConfigError(f"kda_gate_lower_bound must be < 0, got {self.kda_gate_lower_bound}")
        if self.decode_loop_unroll < 1:
            raise ConfigError(f"decode_loop_unroll must be >= 1, got {self.decode_loop_unroll}")
        if self.moe_assigned_splits < 1:
            raise ConfigError(f"moe_assigned_splits must be >= 1, got {self.moe_assigned_splits}")
        for name in ("moe_assigned_glu_tiling", "moe_assigned_down_tiling"):
            parse_kernel_tiling(name, getattr(self, name))
        for name in ("kda_decode_block_v", "moe_decode_row_tile"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ConfigError(f"{name} must be a power of two >= 16, got {v}")
        if self.kda_decode_warps < 1 or self.kda_decode_warps & (self.kda_decode_warps - 1):
            raise ConfigError(f"kda_decode_warps must be a power of two >= 1, got {self.kda_decode_warps}")
        if self.kda_impl == "pallas" and not self.kda_kernel_compatible:
            raise ConfigError(
                "kda_impl='pallas' needs kda_gate='lower_bound' with kda_gate_lower_bound >= -5 (the kernel's f32 "
                f"range) and a power-of-two kda_head_dim >= 16; got kda_gate={self.kda_gate!r}, "
                f"kda_gate_lower_bound={self.kda_gate_lower_bound}, kda_head_dim={self.kda_head_dim}")
        bad = [i for i in self.full_attn_layers if not 1 <= i <= self.num_hidden_layers]
        if bad:
            raise ConfigError(
                f"full_attn_layers are 1-based layer numbers in [1, {self.num_hidden_layers}]; out of range: {bad}")
        if len(set(self.full_attn_layers)) != len(self.full_attn_layers):
            raise ConfigError(f"full_attn_layers has duplicates: {self.full_attn_layers}")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace={self.first_k_dense_replace} exceeds "
                f"num_hidden_layers={self.num_hidden_layers}")
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError(
                f"num_experts_per_token={self.num_experts_per_token} exceeds num_experts={self.num_experts}")
        if self.num_experts % self.num_expert_group:
            raise ConfigError(
                f"num_experts={self.num_experts} is not divisible by num_expert_group={self.num_expert_group}")
        if self.topk_group > self.num_expert_group:
            raise ConfigError(f"topk_group={self.topk_group} exceeds num_expert_group={self.num_expert_group}")
        per_group = self.num_experts // self.num_expert_group
        if self.num_expert_group > 1 and self.topk_group * per_group < self.num_experts_per_token:
            raise ConfigError(
                f"topk_group={self.topk_group} groups of {per_group} experts cannot hold "
                f"num_experts_per_token={self.num_experts_per_token}")
        for name in ["param_dtype", "dtype"]:
            if getattr(self, name) not in _DTYPES:
                raise ConfigError(f"{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")
        for name in ["bos_token_id", "eos_token_id", "pad_token_id"]:
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ConfigError(f"{name}={getattr(self, name)} must be in [0, vocab_size={self.vocab_size})")
        if self.num_nextn_predict_layers > 1:
            raise ConfigError(f"num_nextn_predict_layers > 1 is not supported, got {self.num_nextn_predict_layers}")
        if not _EXPERT_PARALLEL_PATTERN.match(self.moe_expert_parallel) or (
                self.moe_expert_parallel.startswith("capacity:") and not float(self.moe_expert_parallel[9:]) > 0):
            raise ConfigError(f"moe_expert_parallel must be 'auto', 'dropless', 'off', 'capacity' or "
                              f"'capacity:<factor>' with factor > 0 (e.g. 'capacity:1.25'), "
                              f"got {self.moe_expert_parallel!r}")
        if self.latent_moe_use_norm and self.routed_expert_hidden_size is None:
            raise ConfigError("latent_moe_use_norm=True needs routed_expert_hidden_size (the latent width)")
        if self.expert_weights == "mxfp4":
            bad = {n: v for n, v in (("expert width (routed_expert_hidden_size or hidden_size)",
                                      self.expert_input_size), ("moe_intermediate_size", self.moe_intermediate_size))
                   if v % 32}
            if bad:
                raise ConfigError(f"expert_weights='mxfp4' needs both expert matmul input widths divisible by the "
                                  f"MXFP4 group of 32; got {', '.join(f'{n}={v}' for n, v in bad.items())}")
            if self.record_routing_stats:
                raise ConfigError("expert_weights='mxfp4' is inference-only (packed experts have no gradients); "
                                  "training (record_routing_stats=True, set by the trainer) needs "
                                  "expert_weights='bf16'")

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """Builds a config from a plain mapping; unknown keys are an error that suggests the closest field."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in values if k not in names]
        if unknown:
            raise ConfigError(_unknown_keys_message(unknown, names))
        return cls(**dict(values))

    def replace(self, **overrides: Any) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(self)}
        unknown = [k for k in overrides if k not in names]
        if unknown:
            raise ConfigError(_unknown_keys_message(unknown, names))
        return dataclasses.replace(self, **overrides)

    def with_overrides(self, assignments: list[str] | tuple[str, ...]) -> "ModelConfig":
        """Applies `key=value` strings (command-line `--set`), parsing each value by the field's type."""
        hints = typing.get_type_hints(type(self))
        overrides = {}
        for item in assignments:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value")
            key, raw = item.split("=", 1)
            key = key.strip()
            if key not in hints or key not in {f.name for f in dataclasses.fields(self)}:
                raise ConfigError(_unknown_keys_message([key], {f.name for f in dataclasses.fields(self)}))
            overrides[key] = _parse_value(key, raw.strip(), hints[key])
        return self.replace(**overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ numerics
    @property
    def jnp_param_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    # ------------------------------------------------------------------ derived structure
    @property
    def kda_kernel_compatible(self) -> bool:
        """Whether the Pallas KDA kernel can run this config's KDA layers (gate range and head dims)."""
        d = self.kda_head_dim
        return (self.kda_gate == "lower_bound" and self.kda_gate_lower_bound >= -5.0
                and d >= 16 and d & (d - 1) == 0)

    @property
    def kda_projection_size(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def expert_input_size(self) -> int:
        """Width the routed experts read and write: the latent L, or D without a latent."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    def layer_specs(self) -> tuple[LayerSpec, ...]:
        full = set(self.full_attn_layers)
        return tuple(
            LayerSpec(i, "mla" if (i + 1) in full else "kda", "dense" if i < self.first_k_dense_replace else "moe")
            for i in range(self.num_hidden_layers))

    @property
    def num_attn_res_snapshots(self) -> int:
        """Rows of the AttnRes bank: one snapshot at every layer l with l % block == 0 (the first is the embedding)."""
        if not self.uses_attn_res:
            return 0
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    @property
    def unit_length(self) -> int:
        """Length of the repeating decoder unit: the spacing of full-attention layers when regular, else 1."""
        full = sorted(self.full_attn_layers)
        gaps = [b - a for a, b in zip(full, full[1:])]
        if gaps:
            regular = max(set(gaps), key=lambda g: (gaps.count(g), g))  # the most common spacing
            if regular > 1 and self.num_hidden_layers >= 2 * regular:
                return regular
        return 1

    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """Splits the layers into groups: aligned runs of >= 2 identical units are scanned, the rest run singly.

        For `k3`: layers 0..3 singly (layer 0 is dense), 22 scanned units of (KDA, KDA, KDA, MLA) for layers 4..91,
        then layer 92 (the trailing MLA) singly.
        """
        kinds = [(s.attn, s.ffn) for s in self.layer_specs()]
        unit = self.unit_length if self.scan_layers else 1
        groups: list[LayerGroup] = []
        i, n = 0, len(kinds)
        while i < n:
            if unit > 1 and self.scan_layers and i % unit == 0 and i + unit <= n:
                pattern = tuple(kinds[i:i + unit])
                count = 1
                while i + (count + 1) * unit <= n and tuple(kinds[i + count * unit:i + (count + 1) * unit]) == pattern:
                    count += 1
                if count >= 2:
                    groups.append(LayerGroup(i, pattern, count))
                    i += count * unit
                    continue
                for j in range(unit):
                    groups.append(LayerGroup(i + j, (kinds[i + j],), 1))
                i += unit
                continue
            groups.append(LayerGroup(i, (kinds[i],), 1))
            i += 1
        return tuple(groups)


# ---------------------------------------------------------------------- helpers


def _unknown_keys_message(unknown, names) -> str:
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(names), n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unknown config key(s): {', '.join(parts)}"


def _check_type(name: str, value: Any, hint: Any) -> None:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{name} must be one of {list(args)}, got {value!r}")
        return
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return
        inner = [a for a in args if a is not type(None)]
        return _check_type(name, value, inner[0])
    if origin is tuple:
        if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                          for v in value):
            raise ConfigError(f"{name} must be a sequence of ints, got {value!r}")
        return
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be a bool, got {value!r}")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an int, got {value!r}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} must be a number, got {value!r}")
    elif hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")


def _parse_value(name: str, raw: str, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if raw.lower() == "none" and type(None) in args:
            return None
        return _parse_value(name, raw, [a for a in args if a is not type(None)][0])
    if origin is Literal:
        return raw
    if origin is tuple:
        try:
            return tuple(int(x) for x in raw.strip("()[] ").split(",") if x.strip())
        except ValueError:
            raise ConfigError(f"{name} needs comma-separated ints, got {raw!r}") from None
    try:
        if hint is bool:
            if raw.lower() in ("1", "true", "yes"):
                return True
            if raw.lower() in ("0", "false", "no"):
                return False
            raise ValueError
        if hint is int:
            return int(raw)
        if hint is float:
            return float(raw)
    except ValueError:
        raise ConfigError(f"{name} needs a {hint.__name__}, got {raw!r}") from None
    return raw

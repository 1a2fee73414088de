"""ModelConfig: the one description of a K3-family model, validated on construction.

Everything structural (which layers are KDA or MLA, dense or MoE, where AttnRes takes block snapshots, how layers
group into scanned units) is derived here from the released config fields, so no other module re-derives it.
How the model runs (dtypes, scanning, remat, kernel choices, training-time state) is a separate `RuntimeConfig`
held as `ModelConfig.runtime`: every other field is architecture, so conversion needs no list of what to skip.
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


_STATE = {"state": True}  # field metadata: the knob shapes the model's saved state (see RuntimeConfig.state_fields)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How a model is run: numerics, compilation, kernel choices and training-time state. None of it is part of an
    HF `config.json` (conversion neither writes nor compares it); measurements behind the defaults are in
    benchmarks/RESULTS.md (dated sections). Fields marked `_STATE` change the saved training state's layout."""

    # --- numerics and compilation
    param_dtype: str = dataclasses.field(default="bfloat16", metadata=_STATE)  # parameters (training: f32 master)
    dtype: str = "bfloat16"  # activations and matmul operands
    scan_layers: bool = dataclasses.field(default=True, metadata=_STATE)  # repeated units as one scanned group
    remat: bool = True  # recompute each layer's activations in the backward pass
    # What the backward recomputes when `remat` (docs/training.md#memory): "unit" (each scanned unit whole from its
    # input carry; unscanned layers keep their activations), "layer" ("unit" plus a remat region per decoder layer
    # inside it and around every unscanned layer: least memory, the forward runs three times), "dots" ("unit"
    # keeping the matmul outputs: less recompute, more memory).
    remat_policy: Literal["unit", "layer", "dots"] = "unit"
    # The backward finishes each layer's weight gradients before passing its input gradient on
    # (k3jax/layers/grad_order.py); off, XLA's GPU scheduler defers them all to the end of a scanned unit.
    tie_layer_gradients: bool = True
    # LM-head cross-entropy (training): 0 = f32 [tokens, vocab] logits then softmax cross-entropy; N > 0 = the
    # fused head + loss in N vocabulary slices (k3jax/ops/head_loss.py), never holding a [tokens, vocab] array.
    loss_vocab_chunks: int = 0
    # --- KDA
    kda_chunk_size: int = 64  # chunk length of the chunkwise KDA form (XLA path and kernel)
    # "auto": the Pallas kernel on GPU/TPU when `kda_kernel_compatible` (K3's lower-bounded gate, power-of-two head
    # dims), else the pure-JAX chunked path; "pallas" forces the kernel (the interpreter on CPU: exact, slow).
    kda_impl: Literal["auto", "chunked", "recurrent", "pallas"] = "auto"
    # Training prologue (short conv → SiLU → q/k L2 norm, k3jax/ops/conv.py): "auto" = one Pallas kernel each way
    # (pallas_kernels/kda/conv_prologue.py) where the "pallas" core runs on a GPU outside a context-parallel mesh,
    # else XLA; "pallas" forces the kernel (the interpreter off a GPU); "xla" (default until timed on a GPU) never.
    kda_conv_impl: Literal["auto", "xla", "pallas"] = "xla"
    kda_conv_block_t: int = 32  # tokens per program of that kernel (a power of two >= 16 dividing T; else XLA)
    kda_conv_warps: int = 4  # warps per program of that kernel (power of two)
    kda_conv_bwd_block_t: int = 16  # the same for its backward kernel (its best tile is smaller, RESULTS.md)
    kda_conv_bwd_warps: int = 4
    # One-token KDA decode on the GPU kernel: "step" (XLA activates q/k/v/g/beta), "prologue" (short conv, norms and
    # gate activations in the kernel), "prologue_output" (default, also the output RMSNorm and gate: fewest launches,
    # fastest in RESULTS.md 2026-12-02). TPU and CPU decode in XLA.
    kda_decode_fusion: Literal["step", "prologue", "prologue_output"] = "prologue_output"
    # Value columns per program of that kernel (a power of two >= 16; the head dim under "prologue_output").
    kda_decode_block_v: int = 32
    kda_decode_warps: int = 4  # warps per program of that kernel (power of two)
    # --- MLA
    # Absorbed one-token decode: "auto" = the paged Pallas kernel (pallas_kernels/mla) on GPU without a
    # multi-device mesh, else "xla" (gather the pages, then einsums); "pallas" forces the kernel (interpreter off GPU).
    mla_decode_impl: Literal["auto", "xla", "pallas"] = "auto"
    mla_decode_splits: int = 0  # page ranges per sequence of that kernel (flash-decoding splits); 0 = auto
    # Training / prefill attention core (k3jax/ops/attention.py): "xla" (f32 scores and softmax, materialised),
    # "cudnn" (GPU flash attention, bf16 operands, documents in its packed layout), "flash"
    # (k3jax/ops/flash_attention.py: blockwise in plain JAX, segment ids, f32 statistics and output, no T x T array)
    # or "auto" (`training_attention_impl`: cudnn on a GPU with 16-bit compute, flash on a TPU, else xla).
    mla_attention_impl: Literal["auto", "xla", "cudnn", "flash"] = "auto"
    mla_flash_block: int = 512  # query and key block (tokens) of mla_attention_impl="flash"
    # documents per row cuDNN's packed layout takes (rows with more: "flash"); 0 = by the backward's workspace
    # (k3jax/ops/attention.py::cudnn_max_segments: 64 at 4,096 x 1, 4 at 131,072 x 1)
    mla_cudnn_max_segments: int = 0
    # --- Block Attention Residuals
    # Each layer's input read + RMSNorm (k3jax/layers/attn_res.py): "auto" = one Pallas kernel each way
    # (pallas_kernels/attn_res.py) on a GPU where the read's bank row count is static, else XLA; "pallas" also runs
    # the interpreter off a GPU (tests); "xla" (default until timed on a GPU) never.
    attn_res_impl: Literal["auto", "xla", "pallas"] = "xla"
    attn_res_block_t: int = 16  # tokens per program of that kernel (power of two >= 16 dividing B·T; else XLA)
    attn_res_warps: int = 4  # warps per program of that kernel (power of two)
    # --- MoE
    # Routed experts: "dropless" (grouped matmul over expert-sorted rows) or "dense" (every expert on every token).
    moe_impl: Literal["dropless", "dense"] = "dropless"
    # Tokens per piece of the single-program dropless experts (0: all at once). Their [N·k, M] intermediates then
    # scale with the piece, not the sequence; each piece is rematerialised in the backward (one more forward of the
    # routed experts). For long sequences (docs/training.md#memory); results equal the unchunked path.
    moe_token_chunk: int = 0
    # Expert parallelism under a mesh with expert axis > 1 (sharding/expert_parallel.py): 'auto' (= dropless),
    # 'dropless' (ragged all-to-all), 'capacity' / 'capacity:<factor>' (static all-to-all, drops counted), 'off'.
    moe_expert_parallel: str = "auto"
    # How routed experts are held: 'bf16' (parameters in param_dtype, trainable) or 'mxfp4' (inference only: E2M1
    # nibbles + E8M0 scales as uint8, decoded inside the grouped matmul).
    expert_weights: Literal["bf16", "mxfp4"] = dataclasses.field(default="bf16", metadata=_STATE)
    # Quantization-aware training of the routed experts (k3jax/ops/mx_quant.py, docs/training.md#qat): 'mxfp4'
    # fake-quantizes their weights (E2M1, one E8M0 scale per 32 inputs) in the forward, straight-through gradients
    # to the unquantized masters; expert_act_qat 'mxfp8' does the same (E4M3) to their matmul inputs.
    expert_qat: Literal["none", "mxfp4"] = "none"
    expert_act_qat: Literal["none", "mxfp8"] = "none"
    moe_decode_row_tile: int = 16  # rows per tile of the decode grouped matmuls (power of two >= 16; GPU only)
    # Decode-step routed experts on the GPU kernels: "planned" (expert-sorted row plan, grouped matmuls), "assigned"
    # (pallas_kernels/moe/assigned.py: top-k ids read directly, no plan) or "auto": assigned up to
    # `assigned.AUTO_MAX_ROWS_PER_EXPERT` rows per expert, where it is faster (RESULTS.md 2026-12-01, 2026-12-02).
    moe_decode_experts: Literal["auto", "planned", "assigned"] = "auto"
    moe_assigned_splits: int = 4  # programs per (expert, column tile) of the "assigned" kernels
    # Load tiles "tk-tn-warps-stages" of the assigned GLU and down kernels ("" = assigned.ASSIGNED_TILING).
    moe_assigned_glu_tiling: str = ""
    moe_assigned_down_tiling: str = ""
    # Launch order of those kernels: "expert" (in-flight programs share a column tile) or "column" (one expert's
    # column tiles side by side).
    moe_assigned_order: Literal["expert", "column"] = "expert"
    # Expert selection of plan-free decode steps: "kernel" (pallas_kernels/moe/select.py: sigmoid, biased top-k and
    # weights in one launch, RESULTS.md 2026-12-02) or "xla" (`route`).
    moe_decode_select: Literal["xla", "kernel"] = "kernel"
    # --- serving loop
    # Decode steps per serving-loop iteration (`lax.scan(unroll=)`): fewer loop launches for N times the compile
    # time; 2 is faster than 1 on a GPU (RESULTS.md 2026-12-02).
    decode_loop_unroll: int = 2
    # --- training-time state
    # MoE layers record each step's routing-margin histogram and expert loads (Quantile Balancing and the training
    # metrics read them; the trainer turns this on).
    record_routing_stats: bool = dataclasses.field(default=False, metadata=_STATE)
    routing_histogram_bins: int = dataclasses.field(default=256, metadata=_STATE)
    # Multimodal training (`train.py --vision_config`): False freezes the vision tower and projector (no gradients,
    # no optimizer state, weights unchanged; docs/training.md#multimodal-data).
    vision_trainable: bool = dataclasses.field(default=True, metadata=_STATE)

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ConfigError(f"{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")
        for name in ("kda_chunk_size", "routing_histogram_bins", "mla_flash_block"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.mla_cudnn_max_segments < 0:
            raise ConfigError(f"mla_cudnn_max_segments must be >= 0 (0 = by workspace), got "
                              f"{self.mla_cudnn_max_segments}")
        if self.loss_vocab_chunks < 0:
            raise ConfigError(f"loss_vocab_chunks must be >= 0, got {self.loss_vocab_chunks}")
        if self.mla_decode_splits < 0:
            raise ConfigError(f"mla_decode_splits must be >= 0, got {self.mla_decode_splits}")
        if self.decode_loop_unroll < 1:
            raise ConfigError(f"decode_loop_unroll must be >= 1, got {self.decode_loop_unroll}")
        if self.moe_token_chunk < 0:
            raise ConfigError(f"moe_token_chunk must be >= 0 (0 = unchunked), got {self.moe_token_chunk}")
        if self.moe_assigned_splits < 1:
            raise ConfigError(f"moe_assigned_splits must be >= 1, got {self.moe_assigned_splits}")
        for name in ("moe_assigned_glu_tiling", "moe_assigned_down_tiling"):
            parse_kernel_tiling(name, getattr(self, name))
        for name in ("kda_decode_block_v", "moe_decode_row_tile", "kda_conv_block_t", "kda_conv_bwd_block_t",
                     "attn_res_block_t"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ConfigError(f"{name} must be a power of two >= 16, got {v}")
        for name in ("kda_decode_warps", "kda_conv_warps", "kda_conv_bwd_warps", "attn_res_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ConfigError(f"{name} must be a power of two >= 1, got {v}")
        if not _EXPERT_PARALLEL_PATTERN.match(self.moe_expert_parallel) or (
                self.moe_expert_parallel.startswith("capacity:") and not float(self.moe_expert_parallel[9:]) > 0):
            raise ConfigError(f"moe_expert_parallel must be 'auto', 'dropless', 'off', 'capacity' or "
                              f"'capacity:<factor>' with factor > 0 (e.g. 'capacity:1.25'), "
                              f"got {self.moe_expert_parallel!r}")
        if self.expert_weights == "mxfp4" and (self.expert_qat != "none" or self.expert_act_qat != "none"):
            raise ConfigError("expert_qat / expert_act_qat fake-quantize trainable experts; expert_weights='mxfp4' "
                              "holds them packed already (serve the export instead, or set expert_weights='bf16')")
        if self.expert_weights == "mxfp4" and self.record_routing_stats:
            raise ConfigError("expert_weights='mxfp4' is inference-only (packed experts have no gradients); "
                              "training (record_routing_stats=True, set by the trainer) needs expert_weights='bf16'")

    def replace(self, **overrides: Any) -> "RuntimeConfig":
        names = _field_names(RuntimeConfig)
        unknown = [k for k in overrides if k not in names]
        if unknown:
            raise ConfigError(_unknown_keys_message(unknown, names))
        return dataclasses.replace(self, **overrides)

    @classmethod
    def state_fields(cls) -> tuple[str, ...]:
        """Knobs that change the saved training state (parameter layout and dtype, routing-statistics arrays): a
        resume needs them unchanged; every other knob may differ between runs of one checkpoint."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("state"))

    @property
    def jnp_param_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Text backbone of Kimi K3 and its relatives. Field names follow the released config where one exists; every
    field but `runtime` is architecture (what an HF `config.json` holds). `replace`, `from_dict` and
    `with_overrides` take runtime knobs as flat keys (or `runtime.<knob>`) and route them to `runtime`."""

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
    max_position_embeddings: int = 1048576
    # --- KDA
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_short_conv_kernel_size: int = 4
    kda_gate: Literal["lower_bound", "softplus"] = "lower_bound"
    kda_gate_lower_bound: float = -5.0
    kda_output_gate: Literal["full_rank", "low_rank"] = "full_rank"
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
    # --- Block Attention Residuals
    attn_res_block_size: int | None = 12  # None: plain residual stream (Kimi-Linear)
    # --- MTP
    num_nextn_predict_layers: int = 0
    # --- how the model runs (not architecture)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        if isinstance(self.full_attn_layers, list):
            object.__setattr__(self, "full_attn_layers", tuple(self.full_attn_layers))
        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "kda_num_heads", "kda_head_dim",
            "kda_short_conv_kernel_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
            "num_experts", "num_experts_per_token", "moe_intermediate_size", "num_expert_group", "topk_group",
            "max_position_embeddings",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ["q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size"]:
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{name} must be > 0 or None, got {v}")
        for name in ["qk_rope_head_dim", "num_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"]:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ["rms_norm_eps", "mla_lora_norm_eps", "activation_situ_beta", "activation_situ_linear_beta",
                     "routed_scaling_factor", "initializer_range"]:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.kda_gate_lower_bound < 0:
            raise ConfigError(f"kda_gate_lower_bound must be < 0, got {self.kda_gate_lower_bound}")
        if self.runtime.kda_impl == "pallas" and not self.kda_kernel_compatible:
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
        for name in ["bos_token_id", "eos_token_id", "pad_token_id"]:
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ConfigError(f"{name}={getattr(self, name)} must be in [0, vocab_size={self.vocab_size})")
        if self.num_nextn_predict_layers > 1:
            raise ConfigError(f"num_nextn_predict_layers > 1 is not supported, got {self.num_nextn_predict_layers}")
        if self.latent_moe_use_norm and self.routed_expert_hidden_size is None:
            raise ConfigError("latent_moe_use_norm=True needs routed_expert_hidden_size (the latent width)")
        run = self.runtime
        if run.loss_vocab_chunks and self.vocab_size % run.loss_vocab_chunks:
            raise ConfigError(f"loss_vocab_chunks={run.loss_vocab_chunks} must divide vocab_size={self.vocab_size}")
        mx = [f"{k}={v!r}" for k, v in (("expert_weights", run.expert_weights), ("expert_qat", run.expert_qat),
                                         ("expert_act_qat", run.expert_act_qat)) if v not in ("bf16", "none")]
        if mx:
            bad = {n: v for n, v in (("expert width (routed_expert_hidden_size or hidden_size)",
                                      self.expert_input_size), ("moe_intermediate_size", self.moe_intermediate_size))
                   if v % 32}
            if bad:
                widths = ', '.join(f'{n}={v}' for n, v in bad.items())
                raise ConfigError(f"{', '.join(mx)} needs both expert matmul input widths divisible by the MXFP4 "
                                  f"group of 32 (the MX block size); got {widths}")

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """Builds a config from a plain mapping (`to_dict`'s nested `runtime`, or runtime knobs as flat keys, as
        older files hold them); unknown keys are an error that suggests the closest field."""
        return cls().replace(**values)

    def replace(self, **overrides: Any) -> "ModelConfig":
        """A copy with `overrides` applied: architecture fields, `runtime` (a RuntimeConfig, or a mapping of knobs
        applied to the current one), and runtime knobs as `knob` or `runtime.knob`."""
        arch, knobs = _split_keys(overrides)
        runtime = arch.pop("runtime", self.runtime)
        if isinstance(runtime, Mapping):
            runtime = self.runtime.replace(**runtime)
        if knobs:
            runtime = runtime.replace(**knobs)
        return dataclasses.replace(self, **arch, runtime=runtime)

    def with_overrides(self, assignments: list[str] | tuple[str, ...]) -> "ModelConfig":
        """Applies `key=value` strings (command-line `--set`), parsing each value by the field's type; a runtime
        knob is named as `knob` or `runtime.knob`."""
        hints = {**typing.get_type_hints(ModelConfig), **typing.get_type_hints(RuntimeConfig)}
        overrides = {}
        for item in assignments:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value")
            key, raw = item.split("=", 1)
            key = key.strip()
            if key == "runtime":
                raise ConfigError("override runtime knobs one by one: `knob=value` or `runtime.knob=value`")
            arch, knobs = _split_keys({key: None})  # raises for an unknown key, naming the closest field
            name = next(iter(arch or knobs))
            overrides[name] = _parse_value(name, raw.strip(), hints[name])
        return self.replace(**overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain values; the runtime knobs nested under "runtime"."""
        return dataclasses.asdict(self)

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
        unit = self.unit_length if self.runtime.scan_layers else 1
        groups: list[LayerGroup] = []
        i, n = 0, len(kinds)
        while i < n:
            if unit > 1 and self.runtime.scan_layers and i % unit == 0 and i + unit <= n:
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

def _field_names(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


_ARCH_FIELDS = _field_names(ModelConfig)  # includes "runtime"
_KNOBS = _field_names(RuntimeConfig)
assert not _ARCH_FIELDS & _KNOBS, "a flat key must name one field"


def _split_keys(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(architecture fields and `runtime`, runtime knobs) of `replace`-style keys: a knob may be written `knob` or
    `runtime.knob`. Unknown keys raise ConfigError suggesting the closest field of either."""
    arch, knobs, unknown = {}, {}, []
    for key, value in values.items():
        name = key.removeprefix("runtime.")
        if name in _KNOBS:
            knobs[name] = value
        elif key in _ARCH_FIELDS:
            arch[key] = value
        else:
            unknown.append(key)
    if unknown:
        raise ConfigError(_unknown_keys_message(unknown, _ARCH_FIELDS | _KNOBS))
    return arch, knobs


def _unknown_keys_message(unknown, names) -> str:
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key.removeprefix("runtime."), sorted(names), n=1)
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
    elif dataclasses.is_dataclass(hint) and not isinstance(value, hint):
        raise ConfigError(f"{name} must be a {hint.__name__}, got {value!r}")


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

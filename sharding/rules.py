"""The single table mapping logical axis names (on parameters and activations) to mesh axes.

Mesh axes: `data` (FSDP + batch), `expert` (expert parallel; also FSDP for non-expert weights), `context`
(sequence; also FSDP for weights), `model` (tensor parallel). A logical name maps to a mesh axis, a tuple of mesh
axes, or None (replicated). Every name a parameter uses must be listed here; `tests/test_sharding_rules.py` enforces it.
"""

from __future__ import annotations

from typing import Iterable

MESH_AXES = ("data", "expert", "context", "model")

LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    # activations
    "batch": ("data", "expert"),
    "seq": "context",
    "act_embed": None,  # hidden width of activations (replicated; tensor parallelism splits heads/mlp instead)
    "act_vocab": "model",  # logits over the vocabulary, like the head's columns
    # embeddings and trunk
    "vocab": "model",
    # FSDP over data, context and expert for non-expert weights: a long-context mesh puts most chips on 'context'
    # (k3 at 1M tokens per sequence: context=256 of 1,024 chips), where replicated weights cannot fit
    "embed": ("data", "context", "expert"),
    "norm": None,
    "mlp": "model",
    # KDA
    "kda_heads": "model",
    "kda_head_dim": None,
    "kda_proj": "model",
    # FSDP of f_b/g_b [rank 128, heads, head_dim] (in f_a/g_a the embed dim has 'data')
    "kda_gate_rank": ("data", "context"),
    "conv_window": None,
    # MLA
    "heads": "model",
    "head_dim": None,
    # FSDP like embed: q_b/kv_b [lora, heads, head_dim] were replicated where heads do not split (model = 1): 8 GB
    # of k3's f32 parameters + momentum per v5p chip, and as much gradient (benchmarks/RESULTS.md, 2026-12-04). In
    # q_a/kv_a [embed, lora] the embed dim already takes these axes (a "reused" fallback, as intended)
    "q_lora": ("data", "context", "expert"),
    "kv_lora": ("data", "context", "expert"),
    "kv_a_out": None,  # kv_a_proj_with_mqa's output [latent | rope] (576): its embed dim is the FSDP one
    # MoE
    "experts_router": None,
    "experts": "expert",
    "expert_latent": ("data", "context"),  # FSDP of the experts' latent dim (their expert dim takes 'expert')
    "expert_mlp": "model",
    # MTP: the [hidden; embedding] concatenation axis of eh_proj (FSDP like embed)
    "mtp_concat": ("data", "context", "expert"),
    # scanned layer stacks
    "layers": None,
    # vision tower + projector (k3jax/vision): FSDP on the tower width like `embed`, tensor parallel on the MLP,
    # the fused qkv columns and the attention output's input; the patch projection's input and the learned position
    # grid replicated (small); the projector's 4x-wide input FSDP, its hidden width tensor parallel
    "vision_embed": ("data", "context", "expert"),
    "vision_mlp": "model",
    "vision_qkv": "model",
    "vision_heads": "model",
    "vision_patch": None,
    "vision_pos_h": None,
    "vision_pos_w": None,
    "vision_merged": ("data", "context", "expert"),
    "vision_merged_out": "model",
}


# Serving: a decode step reads every weight once, so FSDP (weights split over 'data'/'expert' and all-gathered at
# use) would move the non-expert weights and the experts' latent dim across devices on every token. Serving keeps
# tensor parallelism ('model') and expert parallelism ('expert' on the expert axis) and replicates the rest.
SERVING_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    **LOGICAL_AXIS_RULES,
    "embed": None,
    "kda_gate_rank": None,
    "q_lora": None,
    "kv_lora": None,
    "mtp_concat": None,
    "expert_latent": None,
    "vision_embed": None,
    "vision_merged": None,
}


class UnknownLogicalAxisError(KeyError):
    """A parameter or activation uses a logical axis name missing from LOGICAL_AXIS_RULES."""


def mesh_axes_for(logical: Iterable[str | None],
                  rules: dict | None = None) -> tuple[str | tuple[str, ...] | None, ...]:
    """Resolves one tensor's logical axis names to mesh axes (a PartitionSpec's entries) by `rules` (default: the
    training table `LOGICAL_AXIS_RULES`; `SERVING_AXIS_RULES` for inference)."""
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    out = []
    for name in logical:
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise UnknownLogicalAxisError(f"logical axis {name!r} has no rule in sharding/rules.py")
        out.append(rules[name])
    return tuple(out)

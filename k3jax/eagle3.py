"""EAGLE-3 draft (docs/serving.md#drafts): one decoder layer that drafts from the target's AttnRes block outputs.

Position i's features are the target's block outputs of blocks 1, 4 and the last (`feature_blocks`, see
`k3jax.model.AttnResBlocks`), fused by W_E3 (`feature_proj`, [3D, D], initialised to [0 0 I] so a fresh draft
starts from the last block's output); with the (shared) embedding of the next token t_{i+1}:

    g_i       = [f1_i; f4_i; fN_i] @ W_E3
    x_i       = [hidden_norm(g_i) ; embed_norm(Emb(t_{i+1}))] @ eh_proj          # [2D] -> D
    o_i       = norm(Block(x_i))    # one MLA layer (NoPE) with a dense gated MLP, plain residuals
    logits_i  = lm_head(o_i)        # the target's head, shared; predicts t_{i+2}

Drafting further (training-time test, `unrolled`): the draft's own output o stands in for the next position's g,
which the target has not computed yet (o is normed where EAGLE-3 feeds the pre-norm state: hidden_norm rescales
either, and the layer keeps `k3jax.mtp.MTPLayer`'s interface, so `Eagle3Draft` serves it like the MTP draft).
Chain p (the last position with real features) at step s sits at position p + s - 1, takes Emb(t_{p+s}) and
predicts t_{p+s+1}; its query attends to the step-1 rows (real features) at positions <= p and to its own chain's
rows of steps 2..s. That is exactly what the incremental form (`forward_cached`,
`k3jax.inference.eagle3_draft.Eagle3Draft`) attends to at serving time, so training unrolls the computation serving
runs. Training: `k3jax.training.draft` (target frozen). Weights: `save_eagle3` / `load_eagle3`.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from k3jax.atomic import AtomicDir
from k3jax.config import ConfigError, ModelConfig
from k3jax.layers import params
from k3jax.layers.norms import RMSNorm
from k3jax.model import AttnResBlocks, DecoderLayer
from k3jax.numerics import wide

DRAFT_FORMAT = "k3jax-eagle3-draft-v1"
META_FILE = "draft.json"
DEFAULT_UNROLL_STEPS = 7  # training-time test steps (EAGLE-3)


class DraftCheckpointError(ValueError):
    """A draft directory that is missing, malformed, or made for another target architecture."""


def default_feature_blocks(cfg: ModelConfig) -> tuple[int, int, int]:
    """Blocks 1, 4 and the last (the K3 report's choice; 4 clamped to the last block in a smaller model)."""
    n = cfg.num_attn_res_snapshots
    return (1, min(4, n), n)


def check_feature_blocks(cfg: ModelConfig, blocks) -> tuple[int, ...]:
    """`blocks` as a tuple of three block numbers in 1..N (-1: the last); ConfigError otherwise."""
    if not cfg.uses_attn_res:
        raise ConfigError(f"the EAGLE-3 draft reads AttnRes block outputs; config {cfg.name!r} has plain residuals "
                          f"(attn_res_block_size=None)")
    n = cfg.num_attn_res_snapshots
    blocks = tuple(n if int(b) == -1 else int(b) for b in blocks)
    if len(blocks) != 3 or not all(1 <= b <= n for b in blocks):
        raise ConfigError(f"feature_blocks must be three AttnRes block numbers in 1..{n} (-1: the last), got "
                          f"{list(blocks)}")
    return blocks


def block_features(blocks: AttnResBlocks, feature_blocks) -> jax.Array:
    """The target's features [B, T, 3D]: the chosen block outputs side by side."""
    return jnp.concatenate([blocks.block(n) for n in feature_blocks], axis=-1)


class Eagle3Layer(nnx.Module):
    """The draft (module docstring): W_E3 (`feature_proj`), the input fusion (`hidden_norm`, `embed_norm`,
    `eh_proj`), one decoder layer (`block`: MLA + dense MLP, plain residuals) and its final `norm`; the embedding
    and head are the target's, passed in by the caller."""

    def __init__(self, cfg: ModelConfig, *, feature_blocks=None, rngs: nnx.Rngs):
        self.cfg = cfg
        self.feature_blocks = check_feature_blocks(cfg, feature_blocks or default_feature_blocks(cfg))
        d, pd = cfg.hidden_size, cfg.runtime.jnp_param_dtype
        w_e3 = jnp.concatenate([jnp.zeros((2 * d, d), jnp.float32), jnp.eye(d, dtype=jnp.float32)], axis=0)
        self.feature_proj = params.from_array(w_e3.astype(pd), ("mtp_concat", "embed"))  # W_E3 = [0 0 I]
        self.hidden_norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=pd)
        self.embed_norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=pd)
        self.eh_proj = params.normal(rngs, (2 * d, d), ("mtp_concat", "embed"), pd)
        self.block = DecoderLayer(cfg.replace(attn_res_block_size=None), "mla", "dense", rngs=rngs)
        self.norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=pd)

    # -------------------------------------------------------------------------------------- pieces
    def fuse_features(self, feats_btf: jax.Array) -> jax.Array:
        """g = features @ W_E3: [B, T, 3D] -> [B, T, D]."""
        dt = self.cfg.runtime.jnp_dtype
        return feats_btf.astype(dt) @ self.feature_proj[...].astype(dt)

    def _input(self, g_btd: jax.Array, next_embed_btd: jax.Array) -> jax.Array:
        dt = self.cfg.runtime.jnp_dtype
        x = jnp.concatenate([self.hidden_norm(g_btd).astype(dt), self.embed_norm(next_embed_btd).astype(dt)], -1)
        return x @ self.eh_proj[...].astype(dt)

    # -------------------------------------------------------------------------------------- forms
    def __call__(self, g_btd: jax.Array, next_embed_btd: jax.Array,
                 segment_ids_bt: jax.Array | None = None) -> jax.Array:
        """Step 1 at every position: the draft output o [B, T, D] (normed; the shared head reads it)."""
        h, _ = self.block((self._input(g_btd, next_embed_btd), jnp.zeros((0,) + g_btd.shape, g_btd.dtype)), 0,
                          segment_ids_bt)
        return self.norm(h)

    def forward_cached(self, g_btd: jax.Array, next_embed_btd: jax.Array, pages_npc: jax.Array,
                       page_table_bp: jax.Array, start_b: jax.Array, valid_len_b: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
        """`__call__` for T new positions per sequence continuing the block's MLA latent pages (position
        start_b[b] + t; only the first valid_len_b[b] rows written). Returns (o [B, T, D], new pages)."""
        x = self._input(g_btd, next_embed_btd)
        (h, _), pages_npc = self.block.forward_cached((x, jnp.zeros((0,) + x.shape, x.dtype)), 0, pages_npc,
                                                      start_b, valid_len_b, page_table_bp)
        return self.norm(h), pages_npc

    def unrolled(self, g_btd: jax.Array, embeds_sbtd: list[jax.Array],
                 segment_ids_bt: jax.Array | None = None) -> list[jax.Array]:
        """Training-time test over S = len(embeds_sbtd) steps: the outputs o of every step [B, T, D], row p of
        step s being chain p's (module docstring). embeds_sbtd[s-1][b, p] = Emb(t_{p+s}) (anything where p + s
        is past the row: those chains are masked by the loss). Step s + 1 takes step s's o as its g."""
        mla, layer = self.block.self_attn, self.block
        b, t, _ = g_btd.shape
        causal_tt = jnp.tril(jnp.ones((t, t), bool))
        mask_btt = jnp.broadcast_to(causal_tt, (b, t, t))
        if segment_ids_bt is not None:
            mask_btt = mask_btt & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
        scale = self.cfg.qk_head_dim ** -0.5
        keys1 = values1 = None
        own = []  # (k, v) of this chain's rows from steps 2..s
        outs = []
        for embed_btd in embeds_sbtd:
            x = self._input(g_btd, embed_btd)
            proj, q_bthk, rows_btc = mla.attention_parts(layer.input_layernorm(x))
            k_bthk, v_bthv = mla.expand_rows(rows_btc)
            if keys1 is None:
                keys1, values1 = k_bthk, v_bthv
            else:
                own.append((k_bthk, v_bthv))
            pt = wide(q_bthk.dtype)
            logits_bhts = jnp.einsum("bthk,bshk->bhts", q_bthk, keys1, preferred_element_type=pt) * scale
            logits_bhts = jnp.where(mask_btt[:, None], logits_bhts, -jnp.inf)
            diag_bhtj = [jnp.einsum("bthk,bthk->bht", q_bthk, k, preferred_element_type=pt)[..., None] * scale
                         for k, _ in own]
            probs = jax.nn.softmax(jnp.concatenate([logits_bhts] + diag_bhtj, axis=-1), axis=-1)
            o_bthv = jnp.einsum("bhts,bshv->bthv", probs[..., :t], values1.astype(probs.dtype))
            for j, (_, v) in enumerate(own):
                o_bthv = o_bthv + jnp.transpose(probs[..., t + j], (0, 2, 1))[..., None] * v.astype(probs.dtype)
            h = x + mla.gated_output(proj, o_bthv).astype(x.dtype)
            h = h + layer.mlp(layer.post_attention_layernorm(h)).astype(h.dtype)
            g_btd = self.norm(h)
            outs.append(g_btd)
        return outs


# ------------------------------------------------------------------------------------------ save / load


# config fields a draft does not depend on (a target re-exported with an MTP layer keeps its drafts)
_NOT_CHECKED = ("name", "runtime", "num_nextn_predict_layers", "initializer_range", "max_position_embeddings")


def _architecture(cfg: ModelConfig) -> dict:
    return json.loads(json.dumps({k: v for k, v in cfg.to_dict().items() if k not in _NOT_CHECKED}))


def save_eagle3(layer: Eagle3Layer, out: str, *, overwrite: bool = False, info: dict | None = None) -> str:
    """Writes the draft's weights (Orbax, under `params`) and `draft.json` (format, feature blocks, the target's
    architecture, `info`) into `out` atomically (`k3jax.atomic.AtomicDir`: complete or absent)."""
    tree = jax.tree.map(np.asarray, nnx.state(layer).to_pure_dict())
    with AtomicDir(out, overwrite) as tmp:
        with ocp.PyTreeCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, "params"), tree)
        meta = {"format": DRAFT_FORMAT, "feature_blocks": list(layer.feature_blocks),
                "target_name": layer.cfg.name, "target_architecture": _architecture(layer.cfg), "info": info or {}}
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=1)
    return os.path.abspath(out)


def read_draft_meta(path: str) -> dict:
    """`draft.json` of a draft directory; DraftCheckpointError naming the problem."""
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise DraftCheckpointError(f"{path} is not an EAGLE-3 draft (no {META_FILE}; write one with "
                                   f"python -m k3jax.training.draft)")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DraftCheckpointError(f"{meta_path}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != DRAFT_FORMAT:
        raise DraftCheckpointError(f"{meta_path}: unknown format (expected {DRAFT_FORMAT})")
    return meta


def load_eagle3(path: str, cfg: ModelConfig) -> Eagle3Layer:
    """The draft saved in `path` for a target of config `cfg` (runtime knobs, e.g. dtypes, may differ from the
    training run's; the architecture must not)."""
    meta = read_draft_meta(path)
    want, have = meta.get("target_architecture", {}), _architecture(cfg)
    diffs = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
    if diffs:
        shown = ", ".join(f"{k}: draft {want.get(k)!r} vs target {have.get(k)!r}" for k in diffs[:4])
        raise DraftCheckpointError(f"{path} was trained for another target architecture ({meta.get('target_name')}"
                                   f"; {len(diffs)} field(s) differ: {shown})")
    blocks = tuple(meta["feature_blocks"])
    abstract = nnx.eval_shape(lambda: Eagle3Layer(cfg, feature_blocks=blocks, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract)
    target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), state.to_pure_dict())
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            restored = ckptr.restore(os.path.join(path, "params"), item=target)
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for a damaged directory
        raise DraftCheckpointError(f"{path}: cannot read the draft weights ({type(e).__name__}: {str(e)[:200]})"
                                   ) from None
    shapes_ok = jax.tree.map(lambda a, b: np.shape(a) == np.shape(b), restored, target)
    if not all(jax.tree.leaves(shapes_ok)):
        raise DraftCheckpointError(f"{path}: weight shapes differ from the draft this target needs")
    state.replace_by_pure_dict(jax.tree.map(lambda a, t: jnp.asarray(a, t.dtype), restored, target))
    nnx.update(abstract, state)
    return abstract

"""`python -m k3jax.param_count --config=NAME`: total and activated parameter counts from shapes only.

Shapes come from `nnx.eval_shape` (nothing is allocated), so this works for the 2.8T `k3` config on a laptop.
Activated = every parameter a token touches: all non-routed weights except the input embedding (a lookup), plus
`num_experts_per_token / num_experts` of the routed experts.
"""

from __future__ import annotations

import math

from absl import app, flags
from flax import nnx

import configs
from k3jax.config import ModelConfig
from k3jax.model import K3Model

_ROUTED = ("w1", "w2", "w3")


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Returns {'total_params', 'active_params', 'routed_expert_params', 'embedding_params'}."""
    abstract = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
    total = routed = embedding = 0
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        size = math.prod(var.get_value().shape)
        total += size
        names = [str(p) for p in path]
        if names[-1] in _ROUTED and "mlp" in names:
            routed += size
        if names == ["embed_tokens"]:
            embedding += size
    active_routed = routed * cfg.num_experts_per_token // cfg.num_experts
    active = total - routed - embedding + active_routed
    if cfg.tie_word_embeddings:
        active += embedding  # the tied table is also the head
    return {"total_params": total, "active_params": active, "routed_expert_params": routed,
            "embedding_params": embedding}


def main(argv):
    del argv
    counts = count_params(configs.get_config(flags.FLAGS.config))
    for key, value in counts.items():
        print(f"{key}: {value} ({value / 1e9:.4f}B)")


if __name__ == "__main__":
    flags.DEFINE_string("config", "k3", "Named config (see configs/).")  # here: importing the module defines no flag
    app.run(main)

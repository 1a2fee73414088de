"""Two different models run one after the other in one process compute the same logits as each does alone in a
fresh process: a K3-format checkpoint loaded in bf16, then `jax.clear_caches()`, then a Kimi-Linear-format one in
float32 (the shapes the fault was found with), called twice with one compiled program.

Before the zero-start change in `k3jax/ops/kda_xla.py` (`_chunk_recurrence`, 2026-12-03) the second model's logits
were off by 1.8-3.1x their std and could change from call to call: XLA:CPU read uninitialised memory in a fused
`dot(x, broadcast(0))`, so only a process whose allocator already held used buffers showed it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import k3jax
from configs import kimi_linear
from tests.test_convert_fixtures import write_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A: every K3 layer kind (KDA, MLA, AttnRes, latent MoE) in 5 layers.
A_CFG = configs.get_config("tiny").replace(num_hidden_layers=5, full_attn_layers=(4, 5))
# B: Kimi-Linear format, the shapes the fault was found with (T = 37 fits one 64-token KDA chunk).
B_CFG = kimi_linear.config().replace(
    name="kimi_linear_small", vocab_size=256, hidden_size=128, num_hidden_layers=6, full_attn_layers=(4, 6),
    intermediate_size=256, bos_token_id=0, eos_token_id=1, pad_token_id=2, kda_num_heads=4, kda_head_dim=32,
    num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    num_experts=8, num_experts_per_token=2, moe_intermediate_size=64)

# One model, one forward, in a process of its own: argv = HF dir, dtype, ids .npy, output .npy.
_FRESH = """
import sys
import jax.numpy as jnp
import numpy as np
from flax import nnx
import k3jax
hf_dir, dtype, ids_path, out_path = sys.argv[1:]
_, model = k3jax.load_hf(hf_dir, dtype=dtype)
np.save(out_path, np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(np.load(ids_path)))))
"""


_forward = nnx.jit(lambda model, ids_bt: model(ids_bt))


def _error(got, want):
    """max |got - want| in units of the std of `want`."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / want.std())


@pytest.mark.slow
def test_second_model_in_a_process_matches_a_fresh_process(tmp_path):
    write_hf_dir(tmp_path / "a", A_CFG, k3=True, seed=1, a_log_len=128)
    write_hf_dir(tmp_path / "b", B_CFG, k3=False, seed=2)
    ids_bt = np.random.RandomState(3).randint(0, 256, (2, 37)).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids_bt)
    ids_bt = jnp.asarray(ids_bt)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    fresh = {name: subprocess.Popen([sys.executable, "-c", _FRESH, str(tmp_path / name), dtype,
                                     str(tmp_path / "ids.npy"), str(tmp_path / f"{name}.npy")], env=env)
             for name, dtype in (("a", "bf16"), ("b", "f32"))}
    try:
        _, model_a = k3jax.load_hf(str(tmp_path / "a"), dtype="bf16")
        logits_a = np.asarray(_forward(model_a, ids_bt))
        jax.clear_caches()
        _, model_b = k3jax.load_hf(str(tmp_path / "b"), dtype="f32")
        logits_b = [np.asarray(_forward(model_b, ids_bt)) for _ in range(2)]  # one program, run twice
        for name, proc in fresh.items():
            assert proc.wait(timeout=300) == 0, f"fresh process for model {name} failed"
    finally:
        for proc in fresh.values():
            if proc.poll() is None:
                proc.kill()
    want_a, want_b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    errors = {"A (bf16, K3 format) vs fresh": _error(logits_a, want_a),
              "B (f32, Kimi-Linear format) call 1 vs fresh": _error(logits_b[0], want_b),
              "B call 2 vs fresh": _error(logits_b[1], want_b),
              "B call 2 vs call 1": _error(logits_b[1], logits_b[0])}
    assert max(errors.values()) < 1e-5, f"max |diff| in logit stds: {errors}"

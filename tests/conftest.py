"""Shared fixtures: models loaded with the independent reference's random HF-named weights."""

from __future__ import annotations

import os
import sys

# 8 emulated CPU devices for the sharding tests; set before anything imports jax (appended to any XLA_FLAGS given).
_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES_FLAG).strip()
# The tiny programs the tests run take longer to compile than to run: LLVM's cheap pipeline for the generated code
# (XLA's HLO passes and buffer assignment are unchanged) takes about a third off the suite's time on 2 cores.
_FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ["XLA_FLAGS"] + " " + _FAST_COMPILE_FLAGS).strip()

# The suite is written for CPU devices. With libtpu installed (for the tpu_compile tests) every worker would
# otherwise try to start a TPU backend (and query a metadata server) before falling back to the CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def x64():
    """Runs the test body with float64 enabled (models built with dtype='float64' compute exactly in f64)."""
    import jax

    with jax.enable_x64(True):
        yield


def build_model(cfg, weights=None, seed: int = 0):
    """A K3Model for `cfg` holding `weights` (HF-named dict; random reference weights when None)."""
    from flax import nnx

    from k3jax.convert.hf_names import load_hf_weights
    from k3jax.model import K3Model
    from tests.reference import numpy_k3 as ref

    weights = ref.make_random_weights(cfg, seed=seed) if weights is None else weights
    model = K3Model(cfg, rngs=nnx.Rngs(seed))
    load_hf_weights(model, weights)
    return model, weights


def random_ids(cfg, batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, cfg.vocab_size, (batch, length)).astype(np.int32)


def jit_call(module, *args):
    """Calls `module(*args)` under `nnx.jit` (one compile instead of slow op-by-op eager dispatch)."""
    from flax import nnx

    return nnx.jit(lambda m, *a: m(*a))(module, *args)


class DecodeHarness:
    """One set of random weights for a config and its runtime variants (`cfg.replace(**overrides)` that keep the
    parameter tree, e.g. a kernel choice): jitted cached-forward steps to compare a decode path with the XLA one."""

    def __init__(self, cfg, seed: int, scale: float = 0.1):
        import jax
        import jax.numpy as jnp

        self.cfg = cfg
        self.rng = np.random.default_rng(seed)
        _, abstract = self._split(cfg)
        self.params = jax.tree.map(lambda x: jnp.asarray(scale * self.rng.standard_normal(x.shape), x.dtype),
                                   abstract)

    @staticmethod
    def _split(cfg):
        from flax import nnx

        from k3jax.model import K3Model

        return nnx.split(nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0))))

    def step(self, **overrides):
        """jit((params, ids [B, T], cache, valid_len [B]) -> (logits, new cache)) of the variant."""
        import jax
        from flax import nnx

        graphdef, _ = self._split(self.cfg.replace(**overrides))
        return jax.jit(lambda p, ids, cache, valid: nnx.merge(graphdef, p).forward_cached(ids, cache, valid))

    def ids(self, batch: int, length: int):
        import jax.numpy as jnp

        return jnp.asarray(self.rng.integers(0, self.cfg.vocab_size, (batch, length)), jnp.int32)

    def cache(self, batch: int, max_len: int):
        from k3jax.model import init_cache

        return init_cache(self.cfg, batch, max_len)


def jaxpr_eqns(jaxpr):
    """Every equation of a jaxpr and of its sub-jaxprs (jit, custom_vjp, scan bodies ...), depth first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None:
                yield from jaxpr_eqns(getattr(inner, "jaxpr", inner))


def max_rel_err(got, want) -> float:
    """max |got - want| / max |want| in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


class KDALayerDecode:
    """A tiny f32 KDA layer's one-token cached decode: 4 slots (slot 1 idle: valid 0), a random recurrent state
    and conv history, and `decode(**overrides)` giving the unjitted forward_cached of a config variant."""

    def __init__(self, seed: int):
        import jax.numpy as jnp
        from flax import nnx

        import configs
        from k3jax.layers.kda import KDA

        self.cfg = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32"])
        rng = np.random.default_rng(seed)
        self.x = jnp.asarray(rng.standard_normal((4, 1, self.cfg.hidden_size)), jnp.float32)
        self.valid = jnp.asarray([1, 0, 1, 1], jnp.int32)
        layer = KDA(self.cfg.replace(kda_impl="chunked"), rngs=nnx.Rngs(3))
        state = layer.init_state(4)
        self.state = state._replace(
            state_bhkv=jnp.asarray(rng.standard_normal(state.state_bhkv.shape), jnp.float32),
            conv_bwcp=jnp.asarray(rng.standard_normal(state.conv_bwcp.shape), jnp.float32))
        _, self.params = nnx.split(layer)

    def decode(self, **overrides):
        from flax import nnx

        from k3jax.layers.kda import KDA

        cfg = self.cfg.replace(**overrides)
        graph, _ = nnx.split(nnx.eval_shape(lambda: KDA(cfg, rngs=nnx.Rngs(3))))
        return lambda p, x, st, valid: nnx.merge(graph, p).forward_cached(x, st, valid)

    @property
    def args(self):
        return self.params, self.x, self.state, self.valid


def moe_problem(n: int, seed: int):
    """A routed-experts problem on `tiny` (f32): tokens x, router, bias, latent inputs z, expert weights w1 / w3 / w2
    (latent width 32) and the XLA routing (weights, experts) of x; as a SimpleNamespace."""
    import types

    import jax.numpy as jnp

    import configs
    from k3jax.layers import moe

    cfg = configs.get_config("tiny", ["param_dtype=float32", "dtype=float32"])
    e, lat, m = cfg.num_experts, 32, cfg.moe_intermediate_size
    rng = np.random.default_rng(seed)
    p = types.SimpleNamespace(cfg=cfg)
    p.x = jnp.asarray(rng.standard_normal((n, cfg.hidden_size)), jnp.float32)
    p.router = jnp.asarray(rng.standard_normal((cfg.hidden_size, e)), jnp.float32)
    p.bias = jnp.asarray(0.1 * rng.standard_normal(e), jnp.float32)
    p.z = jnp.asarray(rng.standard_normal((n, lat)), jnp.float32)
    p.w1, p.w3 = (jnp.asarray(rng.standard_normal((e, lat, m)) / np.sqrt(lat), jnp.float32) for _ in range(2))
    p.w2 = jnp.asarray(rng.standard_normal((e, m, lat)) / np.sqrt(m), jnp.float32)
    p.weights, p.experts, _ = moe.route(p.x, p.router, p.bias, cfg)
    return p


@pytest.fixture(scope="module")
def tokenizer():
    """The byte tokenizer of the server tests' model (`tests.test_server.NAME`)."""
    from k3jax.data.text import ByteTokenizer
    from tests.test_inference_cache import tiny_model
    from tests.test_server import NAME

    cfg = tiny_model(NAME).cfg
    return ByteTokenizer(cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.vocab_size)


@pytest.fixture
def compile_cache(tmp_path_factory):
    """A persistent XLA compilation cache for one test: its training runs compile the same step program once."""
    import jax

    from tests.helpers import use_compile_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    old = {n: getattr(jax.config, n) for n in names}
    use_compile_cache(str(tmp_path_factory.mktemp("xla_cache")))
    yield
    for n, v in old.items():
        jax.config.update(n, v)


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
    """Drops every compiled program after each test module. Without it a worker keeps all executables of the
    session (RSS grows to ~6 GB per worker by the end of the default suite), which on CI's 24 GB machine is the
    suspected cause of an abort seen inside an XLA:CPU compile late in the suite."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()

"""The per-device memory estimate and the fit check: exact parameter / optimizer bytes against real shardings and
optax state shapes, the activation formula's behaviour, device memory lookup, and the `k3` answer on this host
without allocating anything."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import configs
from k3jax.training import memory
from k3jax.training.memory import (
    GIB,
    DoesNotFitError,
    check_fit,
    device_memory_bytes,
    estimate_memory,
    smallest_fitting_slice,
)
from k3jax.training.optimizer import make_optimizer
from sharding.mesh import make_mesh
from sharding.plan import auto_mesh
from sharding.shard import plan_shardings


def _abstract_trainable(cfg, mtp=True):
    return nnx.eval_shape(lambda: memory._Trainable(cfg.replace(record_routing_stats=True), mtp=mtp,
                                                    rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("sizes", [(8, 1, 1, 1), (2, 2, 1, 2), (1, 1, 1, 8), (1, 4, 2, 1)])
def test_param_and_state_bytes_equal_the_real_shard_shapes(sizes):
    cfg = configs.get_config("tiny")
    state = nnx.state(_abstract_trainable(cfg))
    plan = plan_shardings(state, make_mesh(*sizes), log_fallbacks=False)
    flat_sharding = dict(nnx.to_flat_state(plan.shardings))
    want = {"params": 0, "other_state": 0}
    for key, var in nnx.to_flat_state(state):
        value = var.get_value()
        shard = flat_sharding[key].get_value().shard_shape(value.shape)
        kind = "params" if isinstance(var, nnx.Param) else "other_state"
        want[kind] += math.prod(shard) * np.dtype(value.dtype).itemsize
    est = estimate_memory(cfg, sizes, batch_size=8, seq_len=32)
    assert {k: est[k] for k in want} == want
    assert est["gradients"] == est["params"]


def test_optimizer_bytes_match_the_optax_state_of_the_trainers_optimizers():
    cfg = configs.get_config("tiny")  # f32 parameters: states are f32 either way
    trainable = _abstract_trainable(cfg)
    for name, tx in (("muon", make_optimizer(trainable, learning_rate=1e-3, mu_dtype=jnp.float32)),
                     ("adamw", optax.adamw(1e-3))):
        opt = nnx.eval_shape(lambda tx=tx: nnx.Optimizer(trainable, tx, wrt=nnx.Param))
        leaves = [x for x in jax.tree.leaves(nnx.state(opt, nnx.optimizer.OptState)) if x.ndim > 0]
        real = sum(x.size * x.dtype.itemsize for x in leaves)
        est = estimate_memory(cfg, (1, 1, 1, 1), batch_size=1, seq_len=8, optimizer=name)
        assert est["optimizer"] == real, name


def test_bf16_parameters_get_an_f32_master_copy_f32_parameters_none():
    tiny = configs.get_config("tiny")
    bf16 = estimate_memory(tiny.replace(param_dtype="bfloat16"), (1, 1, 1, 1), batch_size=8, seq_len=32)
    narrow = sum(math.prod(v.get_value().shape) for _, v in nnx.to_flat_state(nnx.state(
        _abstract_trainable(tiny.replace(param_dtype="bfloat16")), nnx.Param)) if v.get_value().dtype == jnp.bfloat16)
    assert bf16["master"] == 4 * narrow and bf16["master_dtype"] == "float32"  # f32 parameters need none
    assert estimate_memory(tiny, (8, 1, 1, 1), batch_size=8, seq_len=32)["master"] == 0
    none = estimate_memory(tiny.replace(param_dtype="bfloat16"), (8, 1, 1, 1), batch_size=8, seq_len=32,
                           master_dtype=None)
    assert none["master"] == 0
    bf16_state = estimate_memory(tiny, (8, 1, 1, 1), batch_size=8, seq_len=32, state_dtype="bfloat16")
    assert 2 * bf16_state["optimizer"] == estimate_memory(tiny, (8, 1, 1, 1), batch_size=8, seq_len=32)["optimizer"]


def test_activations_grow_with_tokens_per_device_and_shrink_with_data_and_context():
    cfg = configs.get_config("k3_gpu")
    act = {}
    for key, sizes, batch, seq in (("base", (1, 1, 1, 1), 4, 256), ("2x_batch", (1, 1, 1, 1), 8, 256),
                                   ("2x_data", (2, 1, 1, 1), 8, 256), ("2x_ctx", (1, 1, 2, 1), 4, 512)):
        act[key] = estimate_memory(cfg, sizes, batch_size=batch, seq_len=seq)
    assert act["2x_batch"]["activations"] > 1.9 * act["base"]["activations"]
    assert act["2x_data"]["activations"] == act["base"]["activations"]
    assert act["2x_ctx"]["tokens_per_device"] == act["base"]["tokens_per_device"] == 4 * 256
    no_remat = estimate_memory(cfg.replace(remat=False), (1, 1, 1, 1), batch_size=4, seq_len=256)
    assert no_remat["activations"] > act["base"]["activations"]


def test_dropless_expert_parallelism_costs_its_worst_case_receive_buffer():
    cfg = configs.get_config("k3_gpu")
    dropless = estimate_memory(cfg, (1, 8, 1, 1), batch_size=8, seq_len=256)
    capacity = estimate_memory(cfg.replace(moe_expert_parallel="capacity:1.25"), (1, 8, 1, 1), batch_size=8,
                               seq_len=256)
    assert dropless["activations"] > capacity["activations"]
    n, k, ranks = 256, cfg.num_experts_per_token, 8
    assert memory._routed_rows(cfg, n, ranks) == ranks * n * min(k, cfg.num_experts // ranks)
    assert memory._routed_rows(cfg, n, 1) == n * k


def test_routed_experts_in_pieces_count_one_piece_of_rows():
    cfg = configs.get_config("k3_gpu", ["moe_token_chunk=32768"])
    k = cfg.num_experts_per_token
    assert memory._routed_rows(cfg, 131072, 1) == 32768 * k
    assert memory._routed_rows(cfg, 4096, 1) == 4096 * k  # shorter than a piece: unchunked
    whole = estimate_memory(cfg.replace(moe_token_chunk=0), (1, 1, 1, 1), batch_size=1, seq_len=131072)
    pieces = estimate_memory(cfg, (1, 1, 1, 1), batch_size=1, seq_len=131072)
    assert pieces["activations"] < whole["activations"]


def test_device_memory_from_stats_then_table_then_host_ram():
    def fake(platform, kind, stats=None):
        return types.SimpleNamespace(platform=platform, device_kind=kind, memory_stats=lambda: stats)

    assert device_memory_bytes(fake("tpu", "TPU v5p")) == (95 * GIB, "TPU v5p table (95 GiB)")
    assert device_memory_bytes(fake("tpu", "TPU v5 lite"))[0] == 16 * GIB
    assert device_memory_bytes(fake("tpu", "TPU v6 lite"))[0] == 32 * GIB
    h200 = int(140.4 * GIB * memory.gpu_memory_fraction())  # 143,771 MiB x the allocator share
    assert device_memory_bytes(fake("gpu", "NVIDIA H200"))[0] == h200
    assert device_memory_bytes(fake("gpu", "NVIDIA H100 80GB HBM3", {"bytes_limit": 123}))[0] == 123
    cpu_bytes, source = device_memory_bytes()
    assert cpu_bytes == memory.host_memory_bytes() // jax.local_device_count()
    assert source == f"host RAM / {jax.local_device_count()} local cpu devices"


def test_tiny_fits_this_host():
    est = check_fit(configs.get_config("tiny"), make_mesh(data=8), batch_size=8, seq_len=128)
    assert 0 < est["total"] <= est["usable_bytes"]


def test_k3_on_this_host_is_refused_with_needed_available_and_the_smallest_v5p_slice():
    cfg = configs.get_config("k3")
    with pytest.raises(DoesNotFitError) as err:
        check_fit(cfg, (8, 1, 1, 1), batch_size=8, seq_len=128)
    msg = str(err.value)
    assert "config 'k3' (batch 8 x seq 128) on mesh data=8 expert=1 context=1 model=1 needs" in msg
    assert "GiB are usable" in msg and "host RAM" in msg
    chips, mesh, fit = smallest_fitting_slice(cfg, batch_size=8, seq_len=128)
    assert f"smallest TPU v5p slice that fits by the mesh plan (model<=8 expert<=64): {chips} chips" in msg
    assert f"--mesh={','.join(map(str, mesh))}" in msg
    assert fit["total"] <= 0.9 * 95 * GIB
    smaller = max(c for c in memory.V5P_SLICE_CHIPS if c < chips)
    assert estimate_memory(cfg, auto_mesh("k3", smaller), batch_size=8, seq_len=128)["total"] > 0.9 * 95 * GIB


def test_nothing_fits_says_so():
    with pytest.raises(DoesNotFitError, match="no TPU v5p slice up to 6144 chips fits"):
        check_fit(configs.get_config("k3"), (1, 1, 1, 1), batch_size=8, seq_len=1 << 20, device_bytes=GIB)


def test_gathered_weights_are_one_layer_unsharded_over_fsdp_axes_only():
    """`gathered`: the largest layer's weights with FSDP axes all-gathered (compute dtype) + their gradient; expert
    and model ranks still split it, data ranks do not."""
    cfg = configs.get_config("tiny")
    a, p = 4, 4  # tiny: f32 compute and parameters
    layer0 = [r for r in memory._variable_table(cfg, True) if "groups/0/layers/0/" in r[0] and r[4] != "other"]
    dense_layer = sum(math.prod(shape) for _, shape, *_ in layer0) * (a + p)
    one = memory.gathered_layer_bytes(cfg, (1, 1, 1, 1))
    assert one >= dense_layer  # the largest layer is at least the first (dense) one
    assert memory.gathered_layer_bytes(cfg, (8, 1, 1, 1)) == one  # data (FSDP) ranks do not split it
    assert memory.gathered_layer_bytes(cfg, (1, 4, 1, 1)) < one  # expert ranks split the experts
    assert memory.gathered_layer_bytes(cfg, (1, 1, 1, 2)) < one  # model ranks split heads / mlp
    est = estimate_memory(cfg, (8, 1, 1, 1), batch_size=8, seq_len=32)
    assert est["gathered"] == one and est["total"] == sum(est[c] for c in memory.COMPONENTS)


def test_a_long_sequence_refusal_names_the_chunked_loss_head_and_layer_remat():
    cfg = configs.get_config("k3_gpu")  # T = 131072 on one 141 GiB device: full-vocabulary logits dominate
    with pytest.raises(DoesNotFitError) as err:
        check_fit(cfg, (1, 1, 1, 1), batch_size=1, seq_len=131072, device_bytes=141 * GIB)
    msg = str(err.value)
    assert "--set loss_vocab_chunks=16 (the loss heads' f32 logits take" in msg and "--set remat_policy=layer" in msg
    est = estimate_memory(cfg, (1, 1, 1, 1), batch_size=1, seq_len=131072)
    chunked = estimate_memory(cfg.with_overrides(["loss_vocab_chunks=16", "remat_policy=layer"]), (1, 1, 1, 1),
                              batch_size=1, seq_len=131072)
    assert chunked["head_activations"] < est["head_activations"] / 4 and chunked["total"] < est["total"]
    assert memory.knob_hints(cfg.with_overrides(["loss_vocab_chunks=16", "remat_policy=layer"]), chunked) == ""
    # the figure named is the two heads' logits (main + MTP: 3 f32 [T, V] each), not the MTP layer's attention
    assert est["head_logits"] == 2 * 3 * 4 * 131072 * cfg.vocab_size


def test_the_logits_hint_is_not_given_for_the_mtp_layers_attention():
    """A small vocabulary with the XLA attention core at a long T: the MTP layer's T x T scores are large, the
    logits are not; the hint names remat, not the chunked loss head."""
    cfg = configs.get_config("tiny", ["mla_attention_impl=xla"])
    est = estimate_memory(cfg, (1, 1, 1, 1), batch_size=1, seq_len=65536)
    assert est["head_activations"] > 10 * est["head_logits"]
    assert "loss_vocab_chunks" not in memory.knob_hints(cfg, est)


def test_the_estimate_defers_to_a_following_compile_only_while_the_state_alone_fits():
    """`compiled_check_follows`: a total over the device is not refused (flagged `over`) while parameters,
    gradients and optimizer state fit; when they alone do not, it is refused as before."""
    cfg = configs.get_config("k3_gpu")
    est = estimate_memory(cfg, (1, 1, 1, 1), batch_size=1, seq_len=131072)
    state = sum(est[c] for c in memory.STATE_COMPONENTS)
    device = int(state / 0.9) + GIB
    assert est["total"] > device
    with pytest.raises(DoesNotFitError):
        check_fit(cfg, (1, 1, 1, 1), batch_size=1, seq_len=131072, device_bytes=device)
    deferred = check_fit(cfg, (1, 1, 1, 1), batch_size=1, seq_len=131072, device_bytes=device,
                         compiled_check_follows=True)
    assert deferred["over"] and deferred["total"] == est["total"]
    with pytest.raises(DoesNotFitError, match="needs"):
        check_fit(cfg, (1, 1, 1, 1), batch_size=1, seq_len=131072, device_bytes=int(state / 0.9) - GIB,
                  compiled_check_follows=True)


def test_the_compiled_figure_is_arguments_plus_outputs_less_aliased_plus_temporaries_and_refuses_past_the_device():
    f = jax.jit(lambda x, y: x @ y + jnp.tanh(x) @ y, donate_argnums=(0,))
    x = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    compiled = f.lower(x, x).compile()
    counts, total = memory.compiled_memory(compiled)
    assert counts["argument_size_in_bytes"] == 2 * 512 * 512 * 4
    assert counts["alias_size_in_bytes"] == 512 * 512 * 4  # the output reuses the donated x
    assert total == (counts["argument_size_in_bytes"] + counts["output_size_in_bytes"]
                     - counts["alias_size_in_bytes"] + counts["temp_size_in_bytes"]) > 0
    cfg = configs.get_config("tiny")
    est = estimate_memory(cfg, (1, 1, 1, 1), batch_size=1, seq_len=32)
    fit = memory.check_compiled_fit(compiled, cfg, est, batch_size=1, seq_len=32, device_bytes=2 * total)
    assert fit["total"] == total and fit["usable_bytes"] == int(2 * total * 0.95)
    with pytest.raises(DoesNotFitError) as err:
        memory.check_compiled_fit(compiled, cfg, est, batch_size=1, seq_len=32, device_bytes=total)
    msg = str(err.value)
    assert f"the compiled training step needs {total / GIB:.2f} GiB per device (arguments 0.00 GiB" in msg
    assert "nothing was allocated" in msg and "--set remat_policy=layer" in msg

"""Quantile Balancing (`k3jax/training/balancing.py`, docs/spec.md#quantile-balancing): the report's 8-token
example, exact vs histogram quantiles, balancing on skewed scores, and the all-reduced histogram."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.training import balancing as qb
from tests.helpers import expert_load_stats, route_top_k

# Report Fig. 5 setting: m=8 tokens, n=4 experts, k=1 → target load 2 per expert, quantile at 75%.
# Expert popularity 0.8 > 0.6 > 0.4 > 0.2 plus a +0.1 fit of token pair (2j, 2j+1) to expert j: with zero bias
# every token picks expert 0; each pair's fit is what the bias has to expose.
EXAMPLE_SCORES = np.array([
    [0.90, 0.60, 0.41, 0.20],
    [0.91, 0.61, 0.40, 0.21],
    [0.80, 0.71, 0.42, 0.22],
    [0.81, 0.70, 0.40, 0.23],
    [0.82, 0.62, 0.51, 0.20],
    [0.80, 0.63, 0.50, 0.21],
    [0.83, 0.60, 0.41, 0.31],
    [0.81, 0.61, 0.42, 0.30],
], np.float32)


def _loads(scores, bias, k):
    n = scores.shape[-1]
    return np.asarray(expert_load_stats(route_top_k(jnp.asarray(scores), jnp.asarray(bias), k), n)["loads"])


def _margins_np(s, b, k):
    biased = s + b
    alpha = -np.sort(-biased, axis=1)[:, k]
    return s - alpha[:, None]


def test_report_example_balances_to_two_tokens_per_expert():
    s, k = EXAMPLE_SCORES, 1
    b0 = np.zeros(4, np.float32)
    assert _loads(s, b0, k).tolist() == [8, 0, 0, 0]
    r = np.asarray(qb.routing_margins(jnp.asarray(s), jnp.asarray(b0), k))
    np.testing.assert_allclose(r, _margins_np(s, b0, k), atol=1e-7)
    b = np.asarray(jax.jit(qb.quantile_balancing_bias, static_argnums=2)(jnp.asarray(s), jnp.asarray(b0), k))
    b_hat = -np.quantile(_margins_np(s, b0, k).astype(np.float64), 1 - k / 4, axis=0)
    np.testing.assert_allclose(b, b_hat - b_hat.mean(), atol=1e-6)
    assert abs(b.mean()) < 1e-7
    # -b̂_j lies between the 3rd and the 2nd largest margin of expert j (q = m·k/n = 2)...
    sorted_desc = -np.sort(-r, axis=0)
    assert np.all(sorted_desc[2] <= -b_hat) and np.all(-b_hat <= sorted_desc[1])
    # ...and routing with the new bias gives exactly 2 tokens per expert, each pair on its own expert, with a clear
    # gap between every token's chosen and next-best biased score (no ties).
    routes = np.asarray(route_top_k(jnp.asarray(s), jnp.asarray(b), k))[:, 0]
    assert routes.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert _loads(s, b, k).tolist() == [2, 2, 2, 2]
    top2 = -np.sort(-(s + b), axis=1)[:, :2]
    assert (top2[:, 0] - top2[:, 1]).min() > 0.02
    stats = expert_load_stats(jnp.asarray(routes[:, None]), 4)
    assert float(stats["max_over_mean"]) == 1.0 and float(stats["mean_load"]) == 2.0
    # The histogram estimate (bin width 1/128) lands in the same gap: same routing.
    bh = np.asarray(qb.quantile_balancing_bias_histogram(jnp.asarray(s), jnp.asarray(b0), k))
    assert _loads(s, bh, k).tolist() == [2, 2, 2, 2]


def _skewed_scores(rng, m, n, skew=1.5):
    logits = rng.randn(m, n) + skew * np.linspace(1.0, -1.0, n)[None, :]  # strongly preferred low-index experts
    return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)


@pytest.mark.parametrize("num_bins", [128, 256, 512])
def test_histogram_quantile_within_one_bin(num_bins):
    rng = np.random.RandomState(0)
    m, n, k = 4096, 16, 2
    s = _skewed_scores(rng, m, n)
    b = (0.05 * rng.randn(n)).astype(np.float32)
    r = qb.routing_margins(jnp.asarray(s), jnp.asarray(b), k)
    q = 1 - k / n
    exact = np.quantile(np.asarray(r, np.float64), q, axis=0)
    counts = qb.margin_histogram(r, num_bins=num_bins)
    assert counts.shape == (n, num_bins) and int(counts.sum()) == m * n
    est = np.asarray(qb.histogram_quantile(counts, q))
    width = 2.0 / num_bins
    assert np.abs(est - exact).max() <= width, (np.abs(est - exact).max(), width)
    # The full bias: within one bin of the exact one (both mean-centred, so up to 2 bin widths apart).
    b_exact = np.asarray(qb.quantile_balancing_bias(jnp.asarray(s), jnp.asarray(b), k))
    b_hist = np.asarray(jax.jit(qb.quantile_balancing_bias_histogram, static_argnums=2,
                                static_argnames="num_bins")(jnp.asarray(s), jnp.asarray(b), k, num_bins=num_bins))
    assert np.abs(b_hist - b_exact).max() <= 2 * width
    assert abs(b_exact.mean()) < 1e-6 and abs(b_hist.mean()) < 1e-6


def test_histogram_quantile_matches_order_statistics_on_a_grid():
    # Values exactly at bin centres: the estimate is within half a bin of numpy's linear quantile.
    vals = (np.arange(100, dtype=np.float32) + 0.5) / 100 * 2 - 1  # 100 bin centres of [-1, 1)
    r = np.stack([vals, vals[::-1] * 0.5], axis=1)
    counts = qb.margin_histogram(jnp.asarray(r), num_bins=100)
    for q in (0.0, 0.1, 0.5, 0.75, 0.99, 1.0):
        est = np.asarray(qb.histogram_quantile(counts, q))
        np.testing.assert_allclose(est, np.quantile(r, q, axis=0), atol=0.5 * 2 / 100 + 1e-6)


@pytest.mark.parametrize("estimator", ["exact", "histogram"])
def test_bias_balances_the_batch_it_was_computed_on(estimator):
    fn = {"exact": qb.quantile_balancing_bias, "histogram": qb.quantile_balancing_bias_histogram}[estimator]
    rng = np.random.RandomState(1)
    m, n, k = 8192, 64, 8
    s = jnp.asarray(_skewed_scores(rng, m, n, skew=1.0))
    b0 = jnp.zeros(n, jnp.float32)
    before = expert_load_stats(route_top_k(s, b0, k), n)
    assert float(before["max_over_mean"]) > 2.5  # zero bias: badly unbalanced
    b = jax.jit(fn, static_argnums=2)(s, b0, k)
    assert abs(float(b.mean())) < 1e-6
    after = expert_load_stats(route_top_k(s, b, k), n)
    assert float(after["mean_load"]) == m * k / n
    assert float(after["max_over_mean"]) < 1.15, after


@pytest.mark.parametrize("estimator", ["exact", "histogram"])
def test_iterating_on_one_batch_converges_to_balance(estimator):
    """The cutoffs α move when the bias does, so one step from a far-off bias is approximate; each bias is exact
    for the margins of the previous one, and the iteration settles at target loads (to within the histogram's
    resolution for the scalable estimator)."""
    fn = {"exact": qb.quantile_balancing_bias, "histogram": qb.quantile_balancing_bias_histogram}[estimator]
    update = jax.jit(fn, static_argnums=2)
    rng = np.random.RandomState(2)
    m, n, k = 2048, 16, 2
    s = jnp.asarray(_skewed_scores(rng, m, n, skew=1.0))
    b = jnp.zeros(n, jnp.float32)
    ratios = []
    for _ in range(10):
        ratios.append(float(expert_load_stats(route_top_k(s, b, k), n)["max_over_mean"]))
        b = update(s, b, k)
    assert ratios[0] > 2.5 and ratios[1] < 1.4
    assert ratios[-1] < (1.03 if estimator == "exact" else 1.1), ratios


def test_loads_under_the_current_bias_are_counted_by_the_margins():
    """load_j(b) = #{i : r_ij > −b_j} exactly, for the bias b that defined the margins (the identity the
    quantile step inverts)."""
    rng = np.random.RandomState(3)
    m, n, k = 512, 8, 2
    s = _skewed_scores(rng, m, n)
    b = (0.1 * rng.randn(n)).astype(np.float32)
    r = np.asarray(qb.routing_margins(jnp.asarray(s), jnp.asarray(b), k), np.float64)
    # (the (k+1)-th expert sits exactly on its threshold, r_ij = −b_j, up to f32 rounding)
    np.testing.assert_array_equal(_loads(s, b, k), (r > -b[None, :] + 1e-6).sum(axis=0))


def test_repeated_balancing_on_fresh_batches():
    """Used as intended (each step's bias from the previous batch), the loads of new batches stay balanced."""
    rng = np.random.RandomState(4)
    m, n, k = 1024, 8, 2
    b = jnp.zeros(n, jnp.float32)
    update = jax.jit(qb.quantile_balancing_bias_histogram, static_argnums=2)
    ratios = []
    for _ in range(6):
        s = jnp.asarray(_skewed_scores(rng, m, n))
        ratios.append(float(expert_load_stats(route_top_k(s, b, k), n)["max_over_mean"]))
        b = update(s, b, k)
    assert ratios[0] > 2.0 and max(ratios[3:]) < 1.2, ratios


def test_psum_histogram_equals_single_device_histogram():
    rng = np.random.RandomState(3)
    shards, m, n, k = 4, 256, 8, 2
    s = _skewed_scores(rng, shards * m, n)
    b = (0.05 * rng.randn(n)).astype(np.float32)
    single = qb.quantile_balancing_bias_histogram(jnp.asarray(s), jnp.asarray(b), k)
    counts_single = qb.margin_histogram(qb.routing_margins(jnp.asarray(s), jnp.asarray(b), k))

    def per_shard(s_shard):
        r = qb.routing_margins(s_shard, jnp.asarray(b), k)
        return (qb.quantile_balancing_bias_histogram(s_shard, jnp.asarray(b), k, axis_name="data"),
                qb.margin_histogram(r, axis_name="data"))

    bias_v, counts_v = jax.jit(jax.vmap(per_shard, axis_name="data"))(jnp.asarray(s).reshape(shards, m, n))
    for i in range(shards):
        np.testing.assert_array_equal(np.asarray(counts_v[i]), np.asarray(counts_single))
        np.testing.assert_allclose(np.asarray(bias_v[i]), np.asarray(single), atol=1e-6)
    # The same under shard_map over however many devices there are (1 on a plain CPU run).
    ndev = len(jax.devices())
    mesh = jax.make_mesh((ndev,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    from jax.sharding import PartitionSpec as P

    fn = jax.jit(jax.shard_map(
        lambda x: qb.quantile_balancing_bias_histogram(x, jnp.asarray(b), k, axis_name="data")[None],
        mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    out = np.asarray(fn(jax.device_put(jnp.asarray(s), jax.sharding.NamedSharding(mesh, P("data")))))
    for row in out:
        np.testing.assert_allclose(row, np.asarray(single), atol=1e-6)


def test_expert_load_stats():
    ids = jnp.asarray([[0, 1], [0, 2], [0, 3], [1, 2]])
    st = expert_load_stats(ids, 4)
    assert float(st["max_load"]) == 3.0 and float(st["mean_load"]) == 2.0
    assert float(st["max_over_mean"]) == 1.5
    assert np.asarray(st["loads"]).tolist() == [3, 2, 2, 1]

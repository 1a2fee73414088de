"""Speculative decoding: greedy output equals plain greedy decoding for any draft (random, oracle, per-sequence
partial acceptance, MTP), caches after verification equal the plain cached forward over the accepted tokens, and
rejection sampling reproduces the target's distribution (chi-square; fails without the residual step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from k3jax.inference import speculative
from k3jax.inference.drafts import CallbackDraft, MTPDraft, Proposal, RandomDraft
from k3jax.inference.engine import Engine, SamplingParams
from k3jax.inference.sampling import filter_logits
from k3jax.inference.speculative import SpeculativeEngine, accept, verify
from k3jax.model import init_cache
from k3jax.mtp import MTPLayer
from tests.test_inference_cache import tiny_model

NAME = "tiny_kimi_linear"  # engine logic is config-independent (the cache tests cover the K3 layout)
PROMPTS = [[256, 10, 20, 30, 40, 50, 60, 70, 80], [256, 5], [256, 1, 2, 3, 4]]
MAX_LEN = 64
K = 3


@pytest.fixture(scope="module")
def model():
    return tiny_model(NAME)


@pytest.fixture(scope="module")
def plain(model):
    """Plain greedy continuations (no EOS), the reference every greedy test compares with."""
    engine = Engine(model, max_len=MAX_LEN)
    return engine, [r.tokens for r in engine.generate(PROMPTS, 20, eos_id=-1)]


@pytest.fixture(scope="module")
def oracle_engine(model):
    """One engine (one compile) for every host-draft test: each sets `engine.draft.fn`."""
    return SpeculativeEngine(model, CallbackDraft(lambda *a: None, K), max_len=MAX_LEN)


def oracle(plain_tokens, corrupt_at=None):
    """A host draft proposing the plain continuation; `corrupt_at[i]`: sequence i's draft is wrong at that index
    every step (None / >= K: never), so it accepts exactly that many tokens per step."""

    def fn(last_b, out_bn, num_generated_b):
        drafts = np.zeros((len(last_b), K), np.int64)
        for i, g in enumerate(num_generated_b):
            cont = (plain_tokens[i] + [0] * K)[g:g + K] if i < len(plain_tokens) else [0] * K
            drafts[i] = cont
            c = None if corrupt_at is None else corrupt_at[i]
            if c is not None and c < K:
                drafts[i, c] = (drafts[i, c] + 1) % 384
        return drafts

    return fn


def test_greedy_random_draft_equals_plain(model, plain):
    _, ref = plain
    engine = SpeculativeEngine(model, RandomDraft(K, model.cfg.vocab_size), max_len=MAX_LEN)
    got = engine.generate(PROMPTS, [20, 9, 14], eos_id=-1)
    assert [r.tokens for r in got] == [ref[0], ref[1][:9], ref[2][:14]]
    assert engine.last_stats["acceptance_rate"] < 0.1  # rejections everywhere: rollback on nearly every step
    assert engine.trace_counts["spec_step"] == 1


@pytest.mark.slow
def test_greedy_oracle_draft_accepts_everything(oracle_engine, plain):
    _, ref = plain
    engine = oracle_engine
    engine.draft.fn = oracle(ref)
    got = engine.generate(PROMPTS, 20, eos_id=-1)
    assert [r.tokens for r in got] == ref
    # 1 token from prefill, then K + 1 per step: ceil(19 / 4) = 5 steps each, all drafts accepted but the last
    # step's tail beyond the reference (the oracle pads with 0 there)
    assert engine.last_stats["steps_per_sequence"] == [5, 5, 5]
    assert all(a >= 4 * K for a in engine.last_stats["accepted_per_sequence"])


@pytest.mark.slow  # ~24 s; test_spec_serving.py checks different acceptance and finish times in the default suite
def test_batch_accepts_different_counts_and_finishes_at_different_times(oracle_engine, plain):
    plain_engine, ref = plain
    stop = ref[0][7]  # an EOS inside sequence 0's output
    want = plain_engine.generate(PROMPTS, [20, 6, 13], eos_id=stop)
    engine = oracle_engine
    engine.draft.fn = oracle(ref, corrupt_at=[0, None, 1])
    got = engine.generate(PROMPTS, [20, 6, 13], eos_id=stop)
    assert [(r.tokens, r.finish_reason) for r in got] == [(r.tokens, r.finish_reason) for r in want]
    assert got[0].finish_reason == "stop"
    steps, accepted = engine.last_stats["steps_per_sequence"], engine.last_stats["accepted_per_sequence"]
    assert accepted[0] == 0  # wrong at index 0 every step: one (target) token per step
    assert accepted[2] == steps[2]  # wrong at index 1: one accepted draft + the correction per step
    assert accepted[1] >= K and steps[1] == 2  # 1 + 4 + (1 left of 6)
    assert len(set(steps)) == 3  # each finished after its own number of steps
    assert engine.trace_counts["spec_step"] == 1


def _prefilled(model, prompt_ids):
    """A batch cache after prefill of right-padded prompts and each prompt's greedy next token."""
    b, t = len(prompt_ids), max(len(p) for p in prompt_ids)
    ids = np.zeros((b, t), np.int32)
    for i, p in enumerate(prompt_ids):
        ids[i, :len(p)] = p
    lens = jnp.asarray([len(p) for p in prompt_ids], jnp.int32)
    logits, cache = nnx.jit(lambda m, i, c, v: m.forward_cached(i, c, v))(
        model, jnp.asarray(ids), init_cache(model.cfg, b, MAX_LEN), lens)
    last = jnp.argmax(jnp.take_along_axis(logits, (lens - 1)[:, None, None], axis=1)[:, 0], -1).astype(jnp.int32)
    return cache, last


def test_caches_after_verification_equal_plain_cached_forward(model, plain):
    _, ref = plain
    cache, last = _prefilled(model, PROMPTS)
    assert np.asarray(last).tolist() == [r[0] for r in ref]
    # drafts: seq 0 all wrong, seq 1 all right, seq 2 right then wrong -> 0, 3 and 1 accepted
    drafts = np.asarray([[(t + 1) % 384 for t in ref[0][1:4]], ref[1][1:4], [ref[2][1], (ref[2][2] + 1) % 384, 0]])
    n_acc = [0, 3, 1]
    keys = jax.random.split(jax.random.key(0), 3)
    sp = (jnp.zeros(3), jnp.zeros(3, jnp.int32), jnp.ones(3))
    run = nnx.jit(lambda m, c, last, d: verify(m, c, last, Proposal(d, None), jnp.ones(3, bool), keys, sp,
                                               greedy_only=True))
    v = run(model, cache, last, jnp.asarray(drafts, jnp.int32))
    assert np.asarray(v.num_accepted_b).tolist() == n_acc
    assert [np.asarray(v.tokens_bj)[i, :n + 1].tolist() for i, n in enumerate(n_acc)] == [
        ref[0][1:2], ref[1][1:5], ref[2][1:3]]
    step = nnx.jit(lambda m, i, c, valid: m.forward_cached(i, c, valid))
    accepted = np.concatenate([np.asarray(last)[:, None], drafts], 1)
    valid = jnp.asarray(n_acc, jnp.int32) + 1
    # the plain cached forward over the accepted tokens only, from the same cache (other tokens after them):
    # bit-equal
    other = np.where(np.arange(K + 1)[None] < np.asarray(valid)[:, None], accepted, 7)
    _, want = step(model, jnp.asarray(other, jnp.int32), cache, valid)
    _assert_caches_equal(v.cache, want, np.testing.assert_array_equal)
    # the plain decode path (one token per step, as `Engine` decodes them): equal up to the chunked vs recurrent
    # KDA core's and expanded vs absorbed MLA's rounding
    plain_cache = cache
    for t in range(K + 1):
        _, plain_cache = step(model, jnp.asarray(accepted[:, t:t + 1], jnp.int32), plain_cache,
                              (valid > t).astype(jnp.int32))
    _assert_caches_equal(v.cache, plain_cache, lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5))


def _assert_caches_equal(got, want, check):
    """KDA recurrent states and conv histories, MLA latent rows up to each length, and the lengths."""
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    lengths = np.asarray(want.lengths)
    for group_g, group_w in zip(got.layers, want.layers):
        for g, w in zip(group_g, group_w):
            if hasattr(g, "state_bhkv"):  # KDA
                check(np.asarray(g.state_bhkv), np.asarray(w.state_bhkv))
                check(np.asarray(g.conv_bwcp), np.asarray(w.conv_bwcp))
            else:  # MLA pages: every sequence's rows below its length
                for i, n in enumerate(lengths):
                    check(_rows(g, got.page_table[i], n), _rows(w, want.page_table[i], n))


def _rows(pages_npc, table_p, n):
    pages = np.asarray(pages_npc)[np.asarray(table_p)]
    return pages.reshape(-1, pages.shape[-1])[:n]


def _chi_square(samples, probs):
    """Pearson chi-square statistic and its p-value over the cells with probs > 0 (asserting none elsewhere)."""
    counts = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, "tokens outside the target's support"
    expected = probs[support] * len(samples)
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, float(stats.chi2.sf(stat, support.sum() - 1))


def _rejection_sample_stats(n, sp):
    """First-token and (given acceptance) second-token chi-square p-values of `accept` on fixed target logits
    (V = 6, k = 2) with drafts drawn from a different q."""
    v = 6
    logits_jv = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 2.5, 1.0, 1.0, -0.5, 0.3],
                             [1.0, 0.0, 0.0, 2.0, 0.0, 0.0]])
    q_kv = jnp.asarray([[0.05, 0.05, 0.5, 0.3, 0.05, 0.05], [0.4, 0.05, 0.05, 0.05, 0.4, 0.05]])
    kd, ka = jax.random.split(jax.random.key(42))
    draft_nk = jax.vmap(lambda key: jax.vmap(jax.random.categorical)(jax.random.split(key, 2), jnp.log(q_kv)))(
        jax.random.split(kd, n)).astype(jnp.int32)
    spb = tuple(jnp.full((n,), x) for x in sp)
    run = jax.jit(lambda keys: accept(jnp.broadcast_to(logits_jv, (n, 3, v)), Proposal(
        draft_nk, jnp.broadcast_to(q_kv, (n, 2, v))), keys, spb, greedy_only=False))
    tokens, n_acc = (np.asarray(x) for x in run(jax.random.split(ka, n)))
    temperature, top_k, top_p = (jnp.full((3,), x) for x in sp)
    p_jv = np.asarray(jax.nn.softmax(filter_logits(logits_jv, temperature, top_k, top_p), -1), np.float64)
    first = _chi_square(tokens[:, 0], p_jv[0])
    second = _chi_square(tokens[n_acc >= 1, 1], p_jv[1])  # given d1 accepted
    bonus = _chi_square(tokens[n_acc == 2, 2], p_jv[2])  # given both accepted
    return first, second, bonus, float(np.mean(n_acc))


@pytest.mark.parametrize("sp", [(1.0, 0, 1.0), (0.7, 4, 0.9)], ids=["t1", "t0.7_topk4_topp0.9"])
def test_rejection_sampling_matches_target_distribution(sp, monkeypatch):
    n = 40000
    (s1, p1), (s2, p2), (s3, p3), mean_acc = _rejection_sample_stats(n, sp)
    assert min(p1, p2, p3) > 1e-3, (s1, s2, s3)
    assert 0.1 < mean_acc < 1.9  # both accepting and rejecting happen
    # without the residual distribution (resampling from p on a rejection) the first token is visibly off
    monkeypatch.setattr(speculative, "residual_probs", lambda p_bv, q_bv: p_bv)
    (s1_broken, p1_broken), _, _, _ = _rejection_sample_stats(n, sp)
    assert p1_broken < 1e-6, s1_broken


@pytest.mark.slow
def test_sampled_speculative_generation_matches_target_distribution(model):
    """End to end on the tiny model: the first two sampled tokens' joint distribution (top-k 3: 9 cells) under
    speculative decoding with a random draft (rejections everywhere) equals the target's; a greedy row in the same
    batch gets the greedy tokens."""
    n, prompt = 600, [256, 7, 8, 9]
    sps = [SamplingParams(temperature=1.0, top_k=3)] * n + [SamplingParams()]
    engine = SpeculativeEngine(model, RandomDraft(2, model.cfg.vocab_size), max_len=MAX_LEN)
    got = engine.generate([prompt] * (n + 1), 2, sps, eos_id=-1, key=jax.random.key(3))
    pairs = np.asarray([r.tokens for r in got[:n]])
    # the target's probabilities: one full forward over prompt + [t] for every t (causal: position len(prompt) - 1
    # gives p(t1), the last position p(t2 | t1))
    v = model.cfg.vocab_size
    logits = nnx.jit(lambda m, ids: m(ids))(model, jnp.asarray([prompt + [t] for t in range(v)], jnp.int32))
    top3 = (jnp.ones(v), jnp.full(v, 3), jnp.ones(v))
    p1 = np.asarray(jax.nn.softmax(filter_logits(logits[:1, -2], *(x[:1] for x in top3)), -1), np.float64)[0]
    p2 = np.asarray(jax.nn.softmax(filter_logits(logits[:, -1], *top3), -1), np.float64)
    _, pval = _chi_square(pairs[:, 0] * v + pairs[:, 1], (p1[:, None] * p2).reshape(-1))
    assert pval > 1e-3
    first = int(jnp.argmax(logits[0, -2]))
    assert got[n].tokens == [first, int(jnp.argmax(logits[first, -1]))]


class RecordingMTPDraft(MTPDraft):
    """MTPDraft that records (target length, first drafted token) per step on the host."""

    def __init__(self, *args):
        super().__init__(*args)
        self.records = []

    def propose(self, params, state, ctx):
        proposal, state = super().propose(params, state, ctx)
        jax.debug.callback(lambda n, d: self.records.append((np.asarray(n), np.asarray(d))), ctx.lengths_b,
                           proposal.tokens_bk[:, 0])
        return proposal, state


@pytest.fixture(scope="module")
def mtp_engine(model):
    return SpeculativeEngine(model, RecordingMTPDraft(MTPLayer(model.cfg, rngs=nnx.Rngs(1)), K), max_len=MAX_LEN)


@pytest.mark.slow
def test_mtp_draft_greedy_equals_plain_and_drafts_like_training(mtp_engine, model, plain):
    _, ref = plain
    mtp_engine.draft.records.clear()
    got = mtp_engine.generate(PROMPTS, [20, 9, 14], eos_id=-1)
    assert [r.tokens for r in got] == [ref[0], ref[1][:9], ref[2][:14]]
    # every step's first draft is the training-form MTP prediction for that position: MTP position n - 1 (the
    # target's h there, Emb of the pending token at n) predicts the token at n + 1
    full = [p + r.tokens for p, r in zip(PROMPTS, got)]
    t = max(map(len, full))
    ids = jnp.asarray([f + [0] * (t - len(f)) for f in full], jnp.int32)  # right padding: causal, unread

    def training_form(m, mtp, ids):
        return jnp.argmax(m.logits(mtp(m.hidden_states(ids[:, :-1]), m.embed(ids[:, 1:]))), -1)

    mtp = nnx.merge(mtp_engine.draft.graphdef, mtp_engine.draft.params)
    pred = np.asarray(nnx.jit(training_form)(model, mtp, ids))
    checked = 0
    for lengths, first in mtp_engine.draft.records:
        for i, n in enumerate(lengths):
            if n + 1 < len(full[i]):
                assert first[i] == pred[i, n - 1], (i, n)
                checked += 1
    assert checked >= 10


@pytest.mark.slow
def test_mtp_draft_sampled_rows_beside_a_greedy_row(mtp_engine, plain):
    """Sampled rows: the MTP draws from its filtered distribution; the greedy row keeps the greedy tokens."""
    _, ref = plain
    engine = mtp_engine
    mixed = [SamplingParams(), SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=0.7, top_p=0.9)]
    keys = [jax.random.key(i) for i in range(3)]
    got = engine.generate(PROMPTS, 12, mixed, eos_id=-1, key=keys)
    assert got[0].tokens == ref[0][:12] and all(len(r.tokens) == 12 for r in got)
    assert [r.tokens for r in engine.generate(PROMPTS, 12, mixed, eos_id=-1, key=keys)] == [r.tokens for r in got]


def test_mtp_serving_forward_equals_training_forward(model):
    """`MTPLayer.forward_cached` over a sequence in two pieces (its own latent cache) equals the training forward."""
    cfg = model.cfg
    mtp = MTPLayer(cfg, rngs=nnx.Rngs(1))
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 256, (2, 12)), jnp.int32)
    h = nnx.jit(lambda m, i: m.hidden_states(i))(model, ids[:, :-1])
    emb = model.embed(ids[:, 1:])
    want = nnx.jit(lambda m, h, e: m(h, e))(mtp, h, emb)
    draft = MTPDraft(mtp, K)
    pages = draft.init_state(init_cache(cfg, 2, MAX_LEN)).pages_npc
    table = init_cache(cfg, 2, MAX_LEN).page_table
    fwd = nnx.jit(lambda m, h, e, p, s, v: m.forward_cached(h, e, p, table, s, v))
    a, pages = fwd(mtp, h[:, :7], emb[:, :7], pages, jnp.zeros(2, jnp.int32), jnp.full(2, 7, jnp.int32))
    b, _ = fwd(mtp, h[:, 7:], emb[:, 7:], pages, jnp.full(2, 7, jnp.int32), jnp.full(2, 4, jnp.int32))
    np.testing.assert_allclose(np.concatenate([a, b], 1), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_greedy_speculative_equals_plain_on_k3_layout():
    """The K3 layout (`tiny`: AttnRes blocks, latent MoE, scanned units): MTP-draft greedy output == plain greedy."""
    model = tiny_model("tiny")
    want = [r.tokens for r in Engine(model, max_len=MAX_LEN).generate(PROMPTS, [12, 5, 9], eos_id=-1)]
    engine = SpeculativeEngine(model, MTPDraft(MTPLayer(model.cfg, rngs=nnx.Rngs(1)), K), max_len=MAX_LEN)
    assert [r.tokens for r in engine.generate(PROMPTS, [12, 5, 9], eos_id=-1)] == want


def test_bad_arguments_are_one_line_errors(model):
    with pytest.raises(ValueError, match="num_tokens"):
        RandomDraft(0, model.cfg.vocab_size)
    with pytest.raises(ValueError, match="mesh"):
        SpeculativeEngine(model, RandomDraft(K, model.cfg.vocab_size), mesh=object())
    with pytest.raises(ValueError, match=r"\+ 3 drafted .* exceeds the cache capacity"):
        SpeculativeEngine(model, RandomDraft(K, model.cfg.vocab_size), max_len=16).generate([[1] * 6], 9)

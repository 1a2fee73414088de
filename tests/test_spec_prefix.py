"""Speculative drafts observe prompts admitted through the prefix cache or with images (`prefix_admit`,
`spec_slots.spec_extend` / `spec_observe`): after a prefix-cache hit the MTP draft's latent rows of the prompt equal
those of a cold admission (the hit's boundary row rewritten with the new prompt's next token in a private copy of its
page, the first prompt's rows untouched), and greedy tokens equal the plain scheduler's."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from k3jax.eagle3 import Eagle3Layer
from k3jax.inference.drafts import MTPDraft
from k3jax.inference.eagle3_draft import Eagle3Draft
from k3jax.inference.images import prepare_image
from k3jax.inference.scheduler import Request, Scheduler
from k3jax.inference.spec_scheduler import SpeculativeScheduler
from k3jax.mtp import MTPLayer
from tests.test_image_serving import PLACEHOLDER, _image, vlm  # noqa: F401  (the module-scoped fixture)
from tests.test_inference_cache import tiny_model
from tests.test_server import NAME

SHAPE = dict(num_slots=2, max_len=48, page_size=8)  # the 16-token prefix boundary ends a page: the shared-page case
SHARED = [256] + list(range(30, 45))  # one 16-token block
A, B = SHARED + [1, 2, 3, 4], SHARED + [9, 8]  # they differ right after the boundary
TOL = dict(rtol=2e-2, atol=2e-2)  # chunked vs one-shot prefill of the same prompt (float rounding only)


@pytest.fixture(scope="module")
def model():
    return tiny_model(NAME)


@pytest.fixture(scope="module")
def draft(model):
    return MTPDraft(MTPLayer(model.cfg, rngs=nnx.Rngs(1)), 2)


def _slot(sched, rid) -> int:
    return next(i for i, s in enumerate(sched._slots) if s is not None and s.request.request_id == rid)


def draft_rows(sched, rid, n: int) -> np.ndarray:
    """The MTP draft's latent rows [n, C] of positions 0..n-1 of running request `rid` (through its pages)."""
    pages_npc = np.asarray(sched.draft_state.pages_npc)
    return pages_npc[sched.slot_pages(_slot(sched, rid))].reshape(-1, pages_npc.shape[-1])[:n]


def test_draft_rows_after_a_prefix_hit_equal_a_cold_admission_and_tokens_equal_plain(model, draft):
    check_prefix_hit(model, draft)


@pytest.mark.slow
def test_eagle3_draft_rows_after_a_prefix_hit_equal_a_cold_admission_on_k3_layout():
    """The same with an EAGLE-3 draft on `tiny` (AttnRes block features through `spec_extend`)."""
    model = tiny_model("tiny")
    check_prefix_hit(model, Eagle3Draft(Eagle3Layer(model.cfg, rngs=nnx.Rngs(1)), 2))


def check_prefix_hit(model, draft):
    sched = SpeculativeScheduler(model, draft, prefix_block=16, **SHAPE)
    sched.add(Request("a", A, 10, eos_ids=[]))
    events = sched.step()  # a: a miss, the snapshot at 16 kept
    rows_a = draft_rows(sched, "a", len(A))
    sched.add(Request("b", B, 8, eos_ids=[]))
    events += sched.step()  # b: a hit of 16 while a runs
    assert sched.prefix_cache.hits == 1 and sched.page_copies == 1  # the page of position 15 copied, not shared
    np.testing.assert_array_equal(draft_rows(sched, "a", len(A)), rows_a)  # a's rows untouched by b
    rows_b = draft_rows(sched, "b", len(B))

    cold = SpeculativeScheduler(model, draft, **SHAPE)
    cold.add(Request("b", B, 8, eos_ids=[]))
    cold.step()
    want_b = draft_rows(cold, "b", len(B))
    np.testing.assert_allclose(rows_b, want_b, **TOL)
    # the boundary row is b's own (its next token differs from a's): far from a's row there
    assert np.abs(rows_a[15] - want_b[15]).max() > 10 * TOL["atol"]

    events += list(sched.events())
    got = {rid: [e.token for e in events if e.request_id == rid and e.token is not None] for rid in "ab"}
    want = Scheduler(model, **SHAPE).generate([Request("a", A, 10, eos_ids=[]), Request("b", B, 8, eos_ids=[])])
    assert got == {rid: want[rid][0] for rid in "ab"}
    assert sched.speculative_stats()["verify_steps"] > 0


@pytest.mark.slow  # ~46 s; the prefix-hit test above checks the draft's observed rows in the default suite
def test_image_request_is_observed_by_the_draft_and_decodes_like_plain(vlm):  # noqa: F811
    """An image request without the prefix cache goes through the chunked path in one chunk: the draft's rows of
    the prompt equal those written chunk by chunk through the prefix cache; tokens equal the plain scheduler's."""
    text, vision, _ = vlm
    ids = [256, 40, 41] + [PLACEHOLDER] * 6 + [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62]  # 22 tokens
    draft = MTPDraft(MTPLayer(text.cfg, rngs=nnx.Rngs(1)), 2)

    def run(cls, **kw):
        sched = cls(text, **({"draft": draft} if cls is SpeculativeScheduler else {}), **SHAPE, **kw)
        sched.attach_vision(vision, PLACEHOLDER)
        sched.add(Request("i", ids, 6, eos_ids=[], images=(prepare_image(_image(0), vision.cfg),)))
        events = sched.step()
        rows = draft_rows(sched, "i", len(ids)) if cls is SpeculativeScheduler else None
        events += list(sched.events())
        return [e.token for e in events if e.token is not None], rows

    want, _ = run(Scheduler)
    got, rows = run(SpeculativeScheduler)
    got_chunked, rows_chunked = run(SpeculativeScheduler, prefix_block=16)
    assert got == want and got_chunked == want
    assert np.abs(rows).max() > 0
    np.testing.assert_allclose(rows, rows_chunked, **TOL)

"""Chunked prompt admission for the continuous-batching scheduler (`k3jax.inference.scheduler.Scheduler` inherits
`ChunkedAdmission`): a prompt is prefilled alone in chunks of the prefix cache's block, resuming from the longest
cached boundary (KDA states restored, full latent pages shared, the page holding the first position the sequence
may write copied) and snapshotting every kept boundary.

The steps are methods a subclass may extend (`k3jax.inference.spec_scheduler.SpeculativeScheduler` lets its draft
observe every chunk): `_copy_pool_page` (a hit's partial page), `_resume_prefix` (after a hit, before the first
chunk), `_extend_prompt` (one chunk: returns the new per-sequence state, the chunk's last logits and what a kept
snapshot stores beside the state, `PrefixEntry.extra`) and `_install_prompt` (the last chunk's logits -> the first
token, the slot's fields). `prefix_private_tail`: how many positions before a hit's boundary the new sequence
rewrites in its own pages (0 for the target alone; a draft whose row at the boundary depends on the token after
it, like MTP's, needs 1, so the page holding it is copied rather than shared).

Without a prefix cache (`prefix_cache is None`) the same path admits one prompt in a single chunk (the speculative
scheduler's image requests).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from k3jax.inference import sharded
from k3jax.inference.cache import page_table_rows
from k3jax.inference.engine import MIN_PROMPT_BUCKET, bucket
from k3jax.inference.image_slots import extend_chunk
from k3jax.inference.prefix_cache import PrefixEntry
from k3jax.inference.slot_steps import copy_page, install_slots


@dataclasses.dataclass
class PromptAdmission:
    """One prompt being admitted: its request, slot, pages, ids, image tokens (None: text only) and page-table row."""

    request: Any
    slot: int
    pages: list[int]
    ids: list[int]
    tokens_md: Any
    table_1p: np.ndarray
    feats: Any = None  # a subclass's per-chunk values (the speculative scheduler: the draft's features)


class ChunkedAdmission:
    prefix_private_tail = 0  # positions before a hit's boundary the sequence rewrites (module docstring)

    def _admit_with_prefix(self, r, slot: int):
        """Prefill through the prefix cache (module docstring). None: not enough free pages (nothing changed; the
        request keeps waiting)."""
        pc, ps, layout = self.prefix_cache, self.page_size, self.layout.value
        ids = list(r.prompt_ids)
        keys = [] if pc is None else pc.block_keys(self.images.key_ids(ids, r.images) if r.images else ids)
        pos, entry = (0, None) if pc is None else pc.lookup(keys)
        n_shared = max(pos - self.prefix_private_tail, 0) // ps
        shared = list(entry.pages[:n_shared]) if entry is not None else []
        partial = entry.pages[n_shared] if entry is not None and pos > n_shared * ps else None
        held = shared + ([partial] if partial is not None else [])
        self.allocator.ref(held)  # before _allocate, which may evict the entry itself
        own = self._allocate(self.pages_needed(r) - len(shared))
        if own is None:
            self.allocator.release(held)
            return None
        pages = shared + own
        if partial is not None:  # the sharer writes the rest of this page: it gets its own copy
            self._copy_pool_page(partial, own[0])
            self.page_copies += 1
            self.allocator.release([partial])
        if pc is not None:
            pc.record(pos, len(ids))
        adm = PromptAdmission(r, slot, pages, ids, self.images.encode(r.images) if r.images else None,
                              page_table_rows([pages], 1, self.pages_per_seq))
        start = entry.state if entry is not None else self._fresh1
        seq1 = layout.split(start._replace(page_table=jnp.asarray(adm.table_1p)))[0]
        if entry is not None:
            self._resume_prefix(adm, entry, pos)
        end = 0 if pc is None else pc.last_boundary(len(ids))
        while pos < end:
            chunk = np.asarray([ids[pos:pos + pc.block]], np.int32)
            seq1, _, extra = self._extend_prompt(adm, seq1, chunk, pc.block, pos)
            pos += pc.block
            if pc.keeps(pos):
                entry_pages = tuple(pages[:-(-pos // ps)])
                self.allocator.ref(entry_pages)
                pc.store(keys[pos // pc.block - 1], PrefixEntry(
                    layout.without_pools(layout.join(seq1, layout.split(self.cache)[1])), entry_pages, extra))
        rest = ids[pos:]
        chunk = np.full((1, bucket(len(rest), MIN_PROMPT_BUCKET)), self.pad_id, np.int32)
        chunk[0, :len(rest)] = rest
        seq1, logits_nv, _ = self._extend_prompt(adm, seq1, chunk, len(rest), pos)
        tok_n, done_n, lps = self._install_prompt(adm, seq1, logits_nv, pos, len(rest))
        return self._started([r], [slot], [pages], tok_n, done_n, lps)

    def _copy_pool_page(self, src: int, dst: int) -> None:
        """Page dst of every MLA page pool overwritten by page src."""
        layout = self.layout.value
        with sharded.context(self.mesh):
            self._set_pools(copy_page(layout.split(self.cache)[1], jnp.int32(src), jnp.int32(dst), mesh=self._mesh))

    def _resume_prefix(self, adm: PromptAdmission, entry: PrefixEntry, pos: int) -> None:
        """Called on a hit of `pos` tokens before the first chunk (nothing to do for the target alone)."""

    def _extend_prompt(self, adm: PromptAdmission, seq1, chunk_1t: np.ndarray, length: int, pos: int):
        """Prefills `length` tokens of chunk_1t at positions pos..: (new per-sequence state, last-token logits,
        what a snapshot after this chunk keeps beside the state: None)."""
        layout = self.layout.value
        with sharded.context(self.mesh):
            seq1, pools, logits_nv = extend_chunk(
                self.params, seq1, layout.split(self.cache)[1], jnp.asarray(chunk_1t),
                jnp.asarray([length], jnp.int32), spec=self.model_spec, layout=self.layout, mesh=self._mesh,
                images=self.images, tokens_md=adm.tokens_md, ids=adm.ids, start=pos)
        self._set_pools(pools)
        return seq1, logits_nv, None

    def _install_prompt(self, adm: PromptAdmission, seq1, logits_nv, pos: int, length: int):
        """Samples the first token from the last chunk's logits and installs the sequence in its slot: (token,
        done, logprobs) on device."""
        new, slot_n = self._new_fields([adm.request], [adm.slot], 1)
        with sharded.context(self.mesh):
            self.cache, self.state, tok_n, done_n, lps = install_slots(
                self.cache, self.state, seq1, logits_nv, jnp.asarray(slot_n), new, layout=self.layout,
                greedy_only=False, mesh=self._mesh)
        return tok_n, done_n, lps

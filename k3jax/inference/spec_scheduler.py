"""Continuous batching with speculative decoding: `SpeculativeScheduler` is a `Scheduler` whose decode step drafts k
tokens per slot and verifies them in one target forward (`k3jax.inference.spec_slots`; the verification and
rollback are `k3jax.inference.speculative`'s), so each slot emits 1..k+1 tokens per step and slots accept
different counts in the same step.

    sched = SpeculativeScheduler(model, MTPDraft(mtp_layer, 3), num_slots=8, max_len=1024, max_spec_batch=32)
    sched.generate([Request("a", ids, 32)])
    sched.speculative_stats()   # {"verify_steps", "drafted", "accepted", "acceptance_rate", ...}

Greedy requests get exactly the plain scheduler's tokens (the target's argmax decides every token); sampled
requests get the target's distribution (speculative rejection sampling), not the plain step's draws.

Speculation switches itself off for a step (the plain `decode_slots` runs instead) when more than
`max_spec_batch` slots are running: at large batches decode is compute-bound and verifying k+1 tokens per slot
costs about k+1 plain steps, so drafting no longer pays (the issue's target: never slower than plain at batch 64;
the default, 32, is a guess to be tuned by the benchmark). It is also off while a running request asks for
log-probabilities (the plain step computes them) and when `enabled` is False.

It also switches itself off by measurement (`AcceptanceGate`): an exponentially weighted mean of the drafted tokens
accepted per verification, over the first `spec_window` speculative steps and on, is compared with the break-even
`min_accepted_per_step` (default: the cost model `VERIFY_COST_PER_DRAFT`·k); below it every step decodes plainly
(`spec_off_low_acceptance` counts them) and after `probe_every` plain steps speculation is probed again for another
window (the mean starts afresh), so a draft that gets good again is used again. `calibrate()` (run by the server's
warm-up) replaces the cost model by measurement: it times the plain and the speculative step on this scheduler's
slot table and sets the break-even to `break_even_accepted` of the two. (One H200, 2026-12-04, `k3_gpu`, EAGLE-3,
k = 3, step times derived from the benchmark's tokens/s and accepted lengths: ~4 ms plain against ~7 ms speculative
at 1 slot, break-even ~0.8; ~4.3 ms against ~21 ms at 16 slots, break-even ~3.9, more than k: at that table size
speculation cannot pay, yet the cost model's 1.2 let it run, at 0.65x plain.) While a slot decodes plainly its
draft does not observe those tokens: an MTP draft then attends to stale rows for them and proposes worse tokens
for the rest of that request (never wrong output: every token is the target's).

On a device mesh (`mesh=`, as `Scheduler`'s) the draft's parameters are placed by the serving rules like the
target's (`sharded.place_draft_params`), its per-slot state over the slots' batch axes and its shared page pools
replicated (`sharded.slot_axis_shardings`); drafting, verification and rollback run under the mesh in the same
jitted step, so the greedy tokens equal the one-device ones.

Requests admitted through the prefix cache (`prefix_admit.ChunkedAdmission`) or with images go through the chunked
path, whose steps let the draft observe every chunk (`spec_slots.spec_extend` returns the target's features of the
chunk, `spec_observe` writes the draft's rows). On a hit the rows of the cached prefix are the ones its first
prompt's draft wrote (same tokens, same rows) but the row of the prefix's last position depends on the token after
it: the snapshot keeps the target's features of that position (`PrefixEntry.extra`), the hit copies the page
holding it (`prefix_private_tail`) and the draft rewrites the row with this prompt's next token. Image tokens enter
the draft as the target's features of their positions; the draft's own next-token embedding of a placeholder is
the placeholder id's (a weaker draft there, never a wrong output).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.convert.hf_names import MissingTensorError
from k3jax.convert.mtp_load import load_mtp_weights
from k3jax.eagle3 import load_eagle3
from k3jax.inference import sharded
from k3jax.inference.cache import page_table_rows
from k3jax.inference.drafts import Draft, MTPDraft
from k3jax.inference.eagle3_draft import Eagle3Draft
from k3jax.inference.engine import bucket
from k3jax.inference.prefix_admit import PromptAdmission
from k3jax.inference.scheduler import Request, Scheduler, TokenEvent
from k3jax.inference.spec_slots import copy_draft_page, spec_admit_slots, spec_decode_slots, spec_extend, spec_observe
from k3jax.model import K3Model
from k3jax.mtp import MTPLayer

DEFAULT_MAX_SPEC_BATCH = 32
VERIFY_COST_PER_DRAFT = 0.4
"""Cost model of the acceptance rule: a speculative step (draft k tokens, verify k + 1 in one forward) costs about
1 + VERIFY_COST_PER_DRAFT·k plain decode steps at small batch (one H200, 2026-12-04: `k3_gpu` with k = 3 and
nothing accepted ran at 0.45× plain at batch 1, 2.2 plain steps ≈ 1 + 0.4·3; larger batches cost more per
drafted token, which `max_spec_batch` covers). It emits 1 + a tokens (a: drafted tokens accepted), so it pays when
a > VERIFY_COST_PER_DRAFT·k: 1.2 accepted of 3."""


def break_even_accepted(plain_step_s: float, spec_step_s: float, decode_steps: int = 1) -> float:
    """Drafted tokens one verification must accept for speculation to emit tokens as fast as plain decoding: a
    speculative step of `spec_step_s` emits 1 + a tokens per running slot, a plain step call of `plain_step_s`
    emits `decode_steps`; both run every slot of the table, so the break-even does not depend on how many run.
    0 when speculation is never slower (the acceptance rule then never switches it off)."""
    if plain_step_s <= 0 or spec_step_s <= 0:
        raise ValueError(f"step times must be > 0, got plain {plain_step_s}, speculative {spec_step_s}")
    return max(spec_step_s * decode_steps / plain_step_s - 1.0, 0.0)


DEFAULT_SPEC_WINDOW = 16
DEFAULT_PROBE_EVERY = 256
DRAFT_KINDS = ("mtp", "eagle3")


def check_draft_kind(kind: str) -> None:
    if kind not in DRAFT_KINDS:
        raise ValueError(f"unknown draft kind {kind!r} (known: {', '.join(DRAFT_KINDS)})")


def make_draft(kind: str, num_tokens: int, model: K3Model, path: str | None, log: Callable[[str], None],
               seed: int = 0) -> Draft:
    """The serving draft `kind` ("mtp" or "eagle3") proposing `num_tokens` per step, for `model`.
    mtp: the MTP layer with the weights of `path`: a k3jax checkpoint's `mtp` item or an HF directory's
    DeepSeek-style `model.layers.{N}.*` tensors (`k3jax.convert.mtp_load`); no path: randomly initialised (a
    warning: near-zero acceptance, output still exact). eagle3: the draft saved in `path`
    (`k3jax.eagle3.save_eagle3`, trained for this target)."""
    check_draft_kind(kind)
    if kind == "eagle3":
        if path is None:
            raise ValueError("--speculative=eagle3 needs --draft=PATH (a draft directory saved by training)")
        draft = Eagle3Draft(load_eagle3(path, model.cfg), num_tokens)
        log(f"EAGLE-3 draft loaded from {path}")
        return draft
    mtp = MTPLayer(model.cfg, rngs=nnx.Rngs(seed))
    if path is None:
        log("WARNING: --speculative=mtp without --draft, --hf_dir or --checkpoint: the MTP draft is RANDOMLY "
            "INITIALISED (drafts are rarely accepted; the output is still exactly the model's)")
    else:
        if not os.path.isdir(path):
            raise ValueError(f"draft {path!r} is not a directory (expected a k3jax checkpoint with an MTP layer or "
                             "an HF directory with the MTP layer's safetensors)")
        try:
            load_mtp_weights(mtp, path)
        except MissingTensorError as e:
            raise ValueError(e.args[0]) from None
        log(f"MTP draft loaded from {path}")
    return MTPDraft(mtp, num_tokens)


@dataclasses.dataclass
class SpecCounters:
    verify_steps: int = 0  # slot-steps that ran a verification (one per running slot per speculative step)
    drafted: int = 0  # drafted tokens in those
    accepted: int = 0  # drafted tokens accepted
    spec_steps: int = 0  # scheduler steps decoded speculatively
    plain_steps: int = 0  # scheduler steps decoded plainly (batch above max_spec_batch, logprobs, low acceptance
    #                       or disabled)
    off_low_acceptance: int = 0  # of those, steps decoded plainly because the acceptance did not pay


@dataclasses.dataclass
class AcceptanceGate:
    """Speculation on or off by measurement: `observe` takes each speculative step's mean accepted drafted tokens
    per verification into an exponentially weighted mean (span `window`: alpha = 2 / (window + 1)); after `window`
    such steps since speculation (re)started, a mean below `min_accepted` switches it off; `plain_step` counts the
    plain steps while off and after `probe_every` of them switches it on again with a fresh mean (a probe of
    `window` steps). `min_accepted` <= 0: never off."""
    min_accepted: float
    window: int = DEFAULT_SPEC_WINDOW
    probe_every: int = DEFAULT_PROBE_EVERY
    mean: float | None = None  # the weighted mean since speculation (re)started
    spec_steps: int = 0  # speculative steps since speculation (re)started
    plain_steps: int = 0  # plain steps since it switched off
    off: bool = False
    probes: int = 0  # times speculation was switched on again after being off

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"spec_window must be >= 1, got {self.window}")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")

    def observe(self, accepted_per_verify: float) -> None:
        alpha = 2.0 / (self.window + 1)
        self.mean = accepted_per_verify if self.mean is None else (
            (1 - alpha) * self.mean + alpha * accepted_per_verify)
        self.spec_steps += 1
        if self.spec_steps >= self.window and self.mean < self.min_accepted:
            self.off, self.plain_steps = True, 0

    def plain_step(self) -> None:
        if not self.off:
            return
        self.plain_steps += 1
        if self.plain_steps >= self.probe_every:
            self.off, self.mean, self.spec_steps = False, None, 0
            self.probes += 1

    def reset(self) -> None:
        self.mean, self.spec_steps, self.plain_steps, self.off, self.probes = None, 0, 0, False, 0

    def never_pays(self, k: int) -> bool:
        """A break-even of k or more accepted of k drafted: speculation cannot pay with any draft."""
        return self.min_accepted >= k


class SpeculativeScheduler(Scheduler):
    """`Scheduler` + `draft` (k = draft.num_tokens tokens per step); `max_spec_batch`: most running slots that
    still decode speculatively (more: plain decoding for that step); `min_accepted_per_step`, `spec_window`,
    `probe_every`: the acceptance rule's (`AcceptanceGate`; None: `VERIFY_COST_PER_DRAFT`·k; 0: never off). Other
    arguments as `Scheduler`'s (`decode_steps` applies to the plain steps only; a speculative step is one
    verification)."""

    def __init__(self, model: K3Model, draft: Draft, *, max_spec_batch: int = DEFAULT_MAX_SPEC_BATCH,
                 min_accepted_per_step: float | None = None, spec_window: int = DEFAULT_SPEC_WINDOW,
                 probe_every: int = DEFAULT_PROBE_EVERY, draft_name: str = "custom", **kwargs):
        if max_spec_batch < 0:
            raise ValueError(f"max_spec_batch must be >= 0, got {max_spec_batch}")
        given = min_accepted_per_step
        if min_accepted_per_step is None:
            min_accepted_per_step = round(VERIFY_COST_PER_DRAFT * draft.num_tokens, 6)
        self.draft, self.draft_name = draft, draft_name
        self.draft_params = draft.params
        self.max_spec_batch = max_spec_batch
        self.break_even_source = "cost model" if given is None else "given"
        self.gate = AcceptanceGate(float(min_accepted_per_step), spec_window, probe_every)
        self.step_ms: dict[str, float] = {}  # calibrate()'s measured step times
        self._step_times: list[tuple[bool, float]] | None = None  # (speculative, seconds) per step while calibrating
        self._clock = time.perf_counter
        self.enabled = True
        self.counters = SpecCounters()
        self.draft_state = None
        super().__init__(model, **kwargs)  # reset() places the draft's state on the mesh
        self.draft_params = sharded.place_draft_params(draft.params, self.mesh)

    def reset(self) -> list[TokenEvent]:
        events = super().reset()
        self.draft_state = None
        state = self.draft.init_state(self.cache)
        n_leaves, n_axes = len(jax.tree.leaves(state)), len(self.draft.slot_axes())
        if n_leaves != n_axes:
            raise ValueError(f"draft {type(self.draft).__name__}: slot_axes() names {n_axes} axes for a state of "
                             f"{n_leaves} leaves")
        if self.mesh is None:
            self.draft_state = jax.tree.map(lambda x: jnp.array(x, copy=True), state)  # distinct buffers (donated)
        else:
            self.draft_state = sharded.put_slot_axes(state, self.draft.slot_axes(), self.mesh)
        return events

    @property
    def speculating(self) -> bool:
        """Whether the next decode step would run speculatively (by the running slots as they are now)."""
        running = [s.request for s in self._slots if s is not None]
        return (self.enabled and not self.gate.off and not self.gate.never_pays(self.draft.num_tokens)
                and len(running) <= self.max_spec_batch and not any(r.logprobs is not None for r in running))

    def calibrate(self, steps: int = 8) -> dict:
        """Measures the break-even of the acceptance rule: runs every slot for `steps` decode steps plainly, then
        speculatively (each after a run that compiles it), times each step (median) and, unless
        `min_accepted_per_step` was given, sets the rule's break-even to `break_even_accepted` of the two. Returns
        {"plain_step_ms", "spec_step_ms", "break_even", "min_accepted_per_step", "source"}; the scheduler is left
        idle with fresh counters."""
        if steps < 1:
            raise ValueError(f"calibrate: steps must be >= 1, got {steps}")
        if self.has_work:
            raise RuntimeError("calibrate() needs an idle scheduler (requests are queued or running)")
        gate, enabled = self.gate, self.enabled
        self.gate = AcceptanceGate(0.0, gate.window, gate.probe_every)  # never off while measuring
        medians = {}
        try:
            for speculative in (False, True):
                self.enabled = speculative
                for run in range(2):  # the first run compiles
                    self._step_times = []
                    self.generate([Request(f"calibrate-{speculative:d}-{run}-{i}", [0], steps + 1, eos_ids=[])
                                   for i in range(self.num_slots)])
                times = [dt for spec, dt in self._step_times if spec == speculative]
                medians[speculative] = float(np.median(times))
        finally:
            self._step_times, self.enabled, self.gate = None, enabled, gate
        self.counters = SpecCounters()
        self.gate.reset()
        self.step_ms = {"plain": medians[False] * 1e3, "spec": medians[True] * 1e3}
        measured = break_even_accepted(medians[False], medians[True], self.decode_steps)
        if self.break_even_source != "given":
            self.gate.min_accepted, self.break_even_source = round(measured, 6), "measured"
        return {"plain_step_ms": round(self.step_ms["plain"], 3), "spec_step_ms": round(self.step_ms["spec"], 3),
                "break_even": round(measured, 3), "min_accepted_per_step": self.gate.min_accepted,
                "source": self.break_even_source}

    def speculative_stats(self) -> dict:
        c, g = self.counters, self.gate
        return {"draft": self.draft_name, "num_draft_tokens": self.draft.num_tokens,
                "max_spec_batch": self.max_spec_batch, "speculating": self.speculating,
                "min_accepted_per_step": g.min_accepted, "break_even_source": self.break_even_source,
                "pays": not g.never_pays(self.draft.num_tokens),
                "step_ms": {k: round(v, 3) for k, v in self.step_ms.items()}, "accepted_per_step_ewma": g.mean,
                "off_low_acceptance": g.off, "spec_off_low_acceptance": c.off_low_acceptance, "probes": g.probes,
                "verify_steps": c.verify_steps, "drafted": c.drafted, "accepted": c.accepted,
                "acceptance_rate": c.accepted / max(c.drafted, 1),
                "mean_accepted_length": (c.accepted + c.verify_steps) / max(c.verify_steps, 1),
                "spec_steps": c.spec_steps, "plain_steps": c.plain_steps}

    def _admit_batch(self, batch: list[Request], slots: list[int], pages: list[list[int]]) -> list[TokenEvent]:
        """`Scheduler._admit_batch` through `spec_admit_slots` (the draft observes the prompts)."""
        n = sharded.round_up_batch(bucket(len(batch), 1), self.mesh)  # padding rows go to no slot
        ids, lens = self._padded_prompts(batch, n)
        new, slot_n = self._new_fields(batch, slots, n)
        with sharded.context(self.mesh):
            self.cache, self.state, self.draft_state, tok_n, done_n, lps = spec_admit_slots(
                self.params, self.draft_params, self.cache, self.state, self.draft_state, jnp.asarray(ids),
                jnp.asarray(lens), jnp.asarray(slot_n), jnp.asarray(page_table_rows(pages, n, self.pages_per_seq)),
                new, spec=self.model_spec, draft=self.draft, layout=self.layout, max_len=self.max_len,
                page_size=self.page_size, mesh=self._mesh)
        return self._started(batch, slots, pages, tok_n, done_n, lps)

    # ---------------------------------------------------------- chunked admission (prefix cache, images)

    @property
    def prefix_private_tail(self) -> int:
        """A hit copies the page of the position before its boundary: the draft rewrites its row there (an MTP row
        depends on the token after it, which the sharers need not have in common)."""
        return 1 if self.draft.slot_axes() else 0

    def _admit_images(self, r: Request, slot: int) -> list[TokenEvent] | None:
        """Image requests without the prefix cache: the chunked path in one chunk, so the draft observes them."""
        if not self.draft.slot_axes():
            return super()._admit_images(r, slot)
        return self._admit_with_prefix(r, slot)

    def _copy_pool_page(self, src: int, dst: int) -> None:
        super()._copy_pool_page(src, dst)
        if self.draft.slot_axes():
            with sharded.context(self.mesh):
                self.draft_state = copy_draft_page(self.draft_state, jnp.int32(src), jnp.int32(dst),
                                                   axes=self.draft.slot_axes(), mesh=self._mesh)

    def _resume_prefix(self, adm: PromptAdmission, entry, pos: int) -> None:
        """The draft's row of the hit's last cached position, from the target's features kept with the snapshot
        and this prompt's next token (the rows before it are the cached prompt's own, identical)."""
        if self.draft.slot_axes() and entry.extra is not None:
            self._observe_prompt(adm, entry.extra, np.asarray([[adm.ids[pos]]], np.int32), None, pos - 1, 1)

    def _extend_prompt(self, adm: PromptAdmission, seq1, chunk_1t: np.ndarray, length: int, pos: int):
        """The chunk through `spec_extend`; the draft observes it now (its next tokens are the prompt's) or, for
        the prompt's last chunk, after the first token is sampled (`_install_prompt`). A snapshot keeps the
        features of the chunk's last position (`_resume_prefix`)."""
        if not self.draft.slot_axes():
            return super()._extend_prompt(adm, seq1, chunk_1t, length, pos)
        layout = self.layout.value
        rows_md = (None if adm.tokens_md is None
                   else self.images.chunk_rows(adm.tokens_md, adm.ids, pos, chunk_1t.shape[1]))
        with sharded.context(self.mesh):
            seq1, pools, logits_nv, feats_1t = spec_extend(
                self.params, seq1, layout.split(self.cache)[1], jnp.asarray(chunk_1t), rows_md,
                jnp.asarray([length], jnp.int32), spec=self.model_spec, draft=self.draft, layout=self.layout,
                placeholder_id=-1 if rows_md is None else self.images.placeholder_id, mesh=self._mesh)
        self._set_pools(pools)
        next_1t = np.zeros(chunk_1t.shape, np.int32)
        next_1t[0, :len(adm.ids[pos + 1:pos + length + 1])] = adm.ids[pos + 1:pos + length + 1]
        if pos + length < len(adm.ids):
            self._observe_prompt(adm, feats_1t, next_1t, None, pos, length)
        else:
            adm.feats = (feats_1t, next_1t)
        return seq1, logits_nv, feats_1t[:, length - 1:length]

    def _install_prompt(self, adm: PromptAdmission, seq1, logits_nv, pos: int, length: int):
        tok_n, done_n, lps = super()._install_prompt(adm, seq1, logits_nv, pos, length)
        if adm.feats is not None:
            self._observe_prompt(adm, *adm.feats, tok_n, pos, length)
        return tok_n, done_n, lps

    def _observe_prompt(self, adm: PromptAdmission, feats_1t, next_1t: np.ndarray, last_1, pos: int, length: int):
        """`spec_observe` of positions pos..pos + length - 1 of the admitted prompt (last_1: the first sampled
        token, the one after the prompt's end, or None)."""
        last_1 = jnp.full((1,), -1, jnp.int32) if last_1 is None else last_1
        with sharded.context(self.mesh):
            self.draft_state = spec_observe(
                self.params, self.draft_params, self.draft_state, feats_1t, jnp.asarray(next_1t), last_1,
                jnp.asarray([pos], jnp.int32), jnp.asarray([length], jnp.int32), jnp.asarray([adm.slot], jnp.int32),
                jnp.asarray(adm.table_1p), spec=self.model_spec, draft=self.draft, num_slots=self.num_slots,
                mesh=self._mesh)

    def _decode_running(self) -> list[TokenEvent]:
        if self._step_times is None:
            return self._decode_step()
        t0, speculative = self._clock(), self.speculating
        events = self._decode_step()  # synchronous: its tokens are on the host
        self._step_times.append((speculative, self._clock() - t0))
        return events

    def _decode_step(self) -> list[TokenEvent]:
        if not self.speculating:
            self.counters.plain_steps += 1
            self.counters.off_low_acceptance += self.gate.off
            self.gate.plain_step()
            return super()._decode_running()
        running = [s.request for s in self._slots if s is not None]
        greedy_only = all(r.sampling.temperature == 0 for r in running)
        with sharded.context(self.mesh):
            self.cache, self.state, self.draft_state, tok_sj, n_emit_s, done_s, acc_s = spec_decode_slots(
                self.params, self.draft_params, self.cache, self.state, self.draft_state, spec=self.model_spec,
                draft=self.draft, greedy_only=greedy_only, mesh=self._mesh)
        tok_sj, n_emit_s, done_s, acc_s = jax.device_get((tok_sj, n_emit_s, done_s, acc_s))
        c, k = self.counters, self.draft.num_tokens
        c.spec_steps += 1
        events, accepted = [], []
        for slot in np.flatnonzero(n_emit_s):
            if self._slots[slot] is None:
                continue
            c.verify_steps += 1
            c.drafted += k
            c.accepted += int(acc_s[slot])
            accepted.append(int(acc_s[slot]))
            n = int(n_emit_s[slot])
            for j in range(n):
                events.append(self._emit(int(slot), int(tok_sj[slot, j]), bool(done_s[slot]) and j == n - 1))
        if accepted:
            self.gate.observe(float(np.mean(accepted)))
        return events

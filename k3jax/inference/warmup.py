"""Start-up compilation of every program a request can reach, so that no request waits while one compiles (a new
prompt length used to stall every stream for the length of a compile).

`warm_up(scheduler, log)` runs the scheduler through: admission at every prefill batch bucket x prompt-length bucket
(through the prefix cache's chunk programs when it is on, plus its partial-page copy), then the decode step greedy,
sampling, and with log-probabilities (with speculative decoding also the plain greedy and sampling steps, then
`SpeculativeScheduler.calibrate`, which measures when speculation pays). One progress line per program. The server
runs it on the engine thread before the first request; `/health` says "ok" only afterwards. Warm-up requests are
ordinary ones (max_tokens 1 or 2), so the compilations are exactly the ones serving uses; the prefix cache is
emptied afterwards.

With a vision tower (`Scheduler.attach_vision`): the tower for a blank square image of `WARM_UP_IMAGE_SIDE` pixels
(halved until its tokens fit in a prompt; K3: 1024 px, 74 x 74 patches, 1369 tokens) admitted in a prompt of its
own length, and (every bucket) the image prefill at every prompt-length bucket with a one-token image. The tower
compiles once per image grid, so a request with an image of another size still compiles the tower for it; without
the prefix cache, so does an image prefill whose (prompt, image-token) bucket pair was not warmed.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np

from k3jax.inference.engine import MIN_PROMPT_BUCKET, SamplingParams, bucket
from k3jax.inference.images import ImageInput, prepare_image
from k3jax.inference.scheduler import Request, Scheduler
from k3jax.inference.spec_scheduler import SpeculativeScheduler
from k3jax.vision.preprocess import K3_MAX_PATCHES, K3_MAX_SIZE_PER_SIDE, navit_size

WARM_UP_IMAGE_SIDE = 1024  # pixels: the image size whose tower program is compiled at start-up


def prompt_lengths(scheduler: Scheduler) -> list[int]:
    """One prompt length per prefill bucket (the shortest that pads to it): admission pads prompts to a power of two
    >= MIN_PROMPT_BUCKET, capped at max_len; prefix-cache chunks (at most `prefix_block` tokens) are not capped."""
    pc = scheduler.prefix_cache
    longest = scheduler.max_len if pc is None else min(pc.block, scheduler.max_len)
    cap = scheduler.max_len if pc is None else bucket(longest, MIN_PROMPT_BUCKET)
    padded = sorted({min(bucket(n, MIN_PROMPT_BUCKET), cap) for n in _powers_up_to(longest)} |
                    {min(bucket(longest, MIN_PROMPT_BUCKET), cap)})
    return [prev + 1 for prev in [0] + padded[:-1]]


def batch_sizes(scheduler: Scheduler) -> list[int]:
    """Requests admitted together, one count per prefill batch bucket (1 with the prefix cache: one at a time)."""
    if scheduler.prefix_cache is not None:
        return [1]
    return sorted({min(n, scheduler.num_slots) for n in _powers_up_to(scheduler.max_prefill_batch)})


def warm_up_image(scheduler: Scheduler) -> ImageInput | None:
    """The blank square image warm-up compiles the tower for: WARM_UP_IMAGE_SIDE pixels, halved until its tokens
    fit in a prompt of max_len; None without a vision tower."""
    enc = scheduler.images
    if enc is None:
        return None
    p, k = enc.cfg.patch_size, enc.cfg.merge_kernel_size[0]
    side = WARM_UP_IMAGE_SIDE
    while side > p * k:
        _, (ph, pw) = navit_size(side, side, patch_size=p, merge_size=k, max_patches=K3_MAX_PATCHES,
                                 max_size_per_side=K3_MAX_SIZE_PER_SIDE)
        if (ph // p) * (pw // p) // (k * k) < scheduler.max_len:
            break
        side //= 2
    return prepare_image(np.zeros((side, side, 3), np.uint8), enc.cfg)


def image_plan(scheduler: Scheduler, every_bucket: bool) -> list[tuple[str, list[int], ImageInput]]:
    """(what, prompt ids, image) of the image requests warm-up runs (module docstring); [] without a tower. Every
    bucket: a prompt in each prompt-length bucket, holding the warm-up image where it fits (so that image compiles
    nothing in any prompt), else a one-token image."""
    typical = warm_up_image(scheduler)
    if typical is None:
        return []
    ph, m = scheduler.images.placeholder_id, typical.num_tokens
    plan = [(f"vision tower for a {typical.grid[1]} x {typical.grid[2]}-patch image ({m} tokens) and its prefill",
             [ph] * m, typical)]
    if every_bucket:
        p, k = scheduler.images.cfg.patch_size, scheduler.images.cfg.merge_kernel_size[0]
        one = prepare_image(np.zeros((p * k, p * k, 3), np.uint8), scheduler.images.cfg)
        lengths = prompt_lengths(scheduler)
        for n, upper in zip(lengths, [nxt - 1 for nxt in lengths[1:]] + [scheduler.max_len]):
            image = typical if m <= upper else one
            ids = [ph] * image.num_tokens + [1] * (n - image.num_tokens)
            plan.append((f"image prefill of {len(ids)} tokens", ids, image))
    return plan


def run_image_plan(scheduler: Scheduler, images, log: Callable[[str], None], done: int = 0,
                   total: int | None = None) -> None:
    """Runs `image_plan`'s requests (one progress line each, numbered after `done` of `total` programs)."""
    total = len(images) if total is None else total
    for i, (what, ids, image) in enumerate(images):
        t = time.monotonic()
        scheduler.generate([Request(f"warmup-image-{i}", ids, 1, eos_ids=[], images=(image,))])
        log(f"warm-up {done + i + 1}/{total}: {what} compiled ({time.monotonic() - t:.1f}s)")


def warm_up(scheduler: Scheduler, log: Callable[[str], None], every_bucket: bool = True) -> None:
    """Compiles admission for every (batch, prompt length) bucket and the decode step: greedy, sampling, logprobs.
    `every_bucket` False: the shortest bucket only (a quick start; longer prompts compile when they first come)."""
    t0 = time.monotonic()
    plan = [(n, length) for n in batch_sizes(scheduler) for length in prompt_lengths(scheduler)]
    pc = scheduler.prefix_cache
    copy = pc is not None and pc.block + 1 <= scheduler.max_len and pc.block % scheduler.page_size != 0
    if not every_bucket:
        plan, copy = plan[:1], False
    decodes = (("greedy", SamplingParams(), None), ("sampling", SamplingParams(temperature=1.0), None),
               ("logprobs", SamplingParams(), 0))
    images = image_plan(scheduler, every_bucket)
    total = len(plan) + len(images) + len(decodes) + copy
    for i, (n, length) in enumerate(plan):
        t = time.monotonic()
        scheduler.generate([Request(f"warmup-{i}-{j}", [(i + j) % scheduler.cfg.vocab_size] * length, 1,
                                    eos_ids=[]) for j in range(n)])
        log(f"warm-up {i + 1}/{total}: prefill of {n} x {length} tokens compiled ({time.monotonic() - t:.1f}s)")
    run_image_plan(scheduler, images, log, len(plan), total)
    if copy:  # a prefix-cache hit ending inside a page copies that page
        t = time.monotonic()
        prompt = [1] * (pc.block + 1)
        scheduler.generate([Request("warmup-prefix", prompt, 1, eos_ids=[])])
        scheduler.generate([Request("warmup-prefix-hit", prompt, 1, eos_ids=[])])
        log(f"warm-up {total - len(decodes)}/{total}: prefix-cache page copy compiled ({time.monotonic() - t:.1f}s)")
    for k, (what, sampling, logprobs) in enumerate(decodes):
        t = time.monotonic()
        scheduler.generate([Request(f"warmup-decode-{k}", [0], 2, sampling, jax.random.key(0), eos_ids=[],
                                    logprobs=logprobs)])
        log(f"warm-up {total - len(decodes) + 1 + k}/{total}: {what} decode step compiled "
            f"({time.monotonic() - t:.1f}s)")
    if isinstance(scheduler, SpeculativeScheduler):  # the plain steps run above max_spec_batch sequences
        scheduler.enabled = False
        for k, (what, sampling, _) in enumerate(decodes[:2]):
            t = time.monotonic()
            scheduler.generate([Request(f"warmup-plain-{k}", [0], 2, sampling, jax.random.key(0), eos_ids=[])])
            log(f"warm-up: plain {what} decode step (speculation off) compiled ({time.monotonic() - t:.1f}s)")
        scheduler.enabled = True
        t = time.monotonic()
        cal = scheduler.calibrate()  # also leaves fresh counters and acceptance rule
        pays = (f"pays above {cal['min_accepted_per_step']:g} accepted of {scheduler.draft.num_tokens} drafted"
                if not scheduler.gate.never_pays(scheduler.draft.num_tokens) else "never pays: decoding plainly")
        log(f"warm-up: speculation calibrated ({time.monotonic() - t:.1f}s): plain step {cal['plain_step_ms']:.2f} "
            f"ms, speculative step {cal['spec_step_ms']:.2f} ms ({cal['source']} break-even: {pays})")
    if pc is not None:
        pc.clear()
        pc.reset_stats()
        scheduler.page_copies = 0
    log(f"warm-up done: {total} programs in {time.monotonic() - t0:.1f}s")


def _powers_up_to(n: int) -> list[int]:
    out, p = [], 1
    while p <= n:
        out.append(p)
        p *= 2
    return out

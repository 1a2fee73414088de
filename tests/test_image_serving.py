"""Images in /v1/chat/completions: an image request through the server (data URL -> preprocessing -> tower ->
placeholders -> prefill from merged embeddings -> cached decode) gives the multimodal model's own greedy tokens
(full forward, no cache); the image matters; http(s) URLs, undecodable data and a text-only model get clear 400s."""

from __future__ import annotations

import asyncio
import base64
import functools
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.inference.chat import load_chat_template
from k3jax.inference.images import DATA_URL_ONLY, decode_data_url, npy_data_url, prepare_image, prepare_video
from k3jax.inference.openai_api import parse_chat
from k3jax.inference.scheduler import Request, Scheduler
from k3jax.inference.slot_steps import TRACE_COUNTS
from k3jax.inference.warmup import image_plan, run_image_plan, warm_up, warm_up_image
from k3jax.vision import K3VisionLanguageModel, VisionConfig
from tests.test_inference_cache import tiny_model
from tests.test_multimodal_model import TINY_VISION, _random_vision
from tests.test_server import NAME, post, serving

PLACEHOLDER = 259  # the first id after the byte tokenizer's BOS / EOS / PAD
MAX_LEN = 64
N_NEW = 8


def _image(seed: int) -> np.ndarray:
    """uint8 [8, 12, 3]: 4 x 6 patches of 2 px, 6 image tokens after the 2 x 2 merge."""
    return np.random.RandomState(seed).randint(0, 256, (8, 12, 3)).astype(np.uint8)


def _messages(url: str, text: str = "look: ") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": " what?"}]}]


@pytest.fixture(scope="module")
def vlm():
    text = tiny_model(NAME)
    vision, _ = _random_vision(VisionConfig(**TINY_VISION, text_hidden_size=text.cfg.hidden_size), jnp.float32)
    return text, vision, K3VisionLanguageModel(text, vision, placeholder_id=PLACEHOLDER)


@pytest.fixture(scope="module")
def image_scheduler(vlm):
    text, vision, _ = vlm
    sched = Scheduler(text, num_slots=2, max_len=MAX_LEN)
    sched.attach_vision(vision, PLACEHOLDER)
    return sched


@functools.lru_cache(maxsize=None)
def _full_forward(model: K3VisionLanguageModel, grids: tuple[tuple[int, int, int], ...]):
    layout = model.layout(list(grids))
    return nnx.jit(lambda m, i, p: m(i, p, layout))


def direct_greedy(model: K3VisionLanguageModel, ids: list[int], image, n: int) -> list[int]:
    """The multimodal model's greedy continuation by full forwards (no cache), the independent reference. `image`:
    a uint8 picture, or preprocessed `ImageInput`s (video chunks)."""
    inputs = (prepare_image(image, model.vision.cfg),) if isinstance(image, np.ndarray) else tuple(image)
    full = _full_forward(model, tuple(im.grid for im in inputs))
    pixels = jnp.asarray(np.concatenate([im.pixels for im in inputs], axis=0))
    seq = list(ids)
    for _ in range(n):
        row = np.zeros((1, MAX_LEN), np.int32)  # causal: positions after len-1 do not change its logits
        row[0, :len(seq)] = seq
        logits = np.asarray(full(model, jnp.asarray(row), pixels))[0, len(seq) - 1]
        seq.append(int(np.argmax(logits)))
    return seq[len(ids):]


def test_image_request_through_the_server_equals_the_multimodal_model(vlm, image_scheduler, tokenizer):
    _, vision, model = vlm
    chat = load_chat_template(tokenizer, None)
    im_a, im_b = _image(0), _image(1)
    num = prepare_image(im_a, vision.cfg).num_tokens
    ids = chat.encode(parse_chat({"messages": _messages("data:,")}).messages, [[PLACEHOLDER] * num])
    assert ids.count(PLACEHOLDER) == num == 6
    want_a = direct_greedy(model, ids, im_a, N_NEW)
    want_b = direct_greedy(model, ids, im_b, N_NEW)
    assert want_a != want_b  # the image matters

    eos = model.language_model.cfg.eos_token_id
    cut_a, cut_b = (w[:w.index(eos)] if eos in w else w for w in (want_a, want_b))
    got = image_scheduler.generate([Request(k, ids, N_NEW, eos_ids=[eos], images=(prepare_image(im, vision.cfg),))
                                    for k, im in (("a", im_a), ("b", im_b))])
    assert got["a"][0] == cut_a and got["b"][0] == cut_b

    async def go():
        async with serving(image_scheduler, tokenizer, max_queue=4) as (server, client, logs, _):
            return await asyncio.gather(*[post(client, "/v1/chat/completions", {
                "messages": _messages(npy_data_url(im)), "max_tokens": N_NEW, "temperature": 0})
                for im in (im_a, im_b)])

    for (status, body), want in zip(asyncio.run(go()), (cut_a, cut_b)):
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == tokenizer.decode(want)
        assert body["usage"]["completion_tokens"] == len(want)
        assert body["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.slow  # ~16 s; the image request test checks the tokens by default
def test_image_prompts_through_the_prefix_cache_match_only_the_same_image(vlm, tokenizer):
    """Prefix-cache keys hold the image's pixel digest: the same prompt with the same image resumes from the last
    boundary, with another image from none (its first block already holds a placeholder); every output equals the
    multimodal model's own. Chunks split the image's placeholders at the 16-token boundary."""
    text, vision, model = vlm
    sched = Scheduler(text, num_slots=2, max_len=MAX_LEN, prefix_block=16)
    sched.attach_vision(vision, PLACEHOLDER)
    im_a, im_b = _image(0), _image(1)
    num = prepare_image(im_a, vision.cfg).num_tokens
    ids = load_chat_template(tokenizer, None).encode(parse_chat({"messages": _messages("data:,", "look:")}).messages,
                                                     [[PLACEHOLDER] * num])
    assert ids.index(PLACEHOLDER) < 16 < ids.index(PLACEHOLDER) + num and 32 < len(ids) < 48
    want = {k: direct_greedy(model, ids, im, N_NEW) for k, im in (("a", im_a), ("b", im_b))}
    pc = sched.prefix_cache
    for k, im, saved in (("a", im_a, 0), ("a", im_a, 32), ("b", im_b, 0)):
        before = pc.tokens_saved
        got = sched.generate([Request(k, ids, N_NEW, eos_ids=[], images=(prepare_image(im, vision.cfg),))])
        assert got[k][0] == want[k] and pc.tokens_saved - before == saved


def test_bad_images_and_a_text_only_model_get_clear_400s(image_scheduler, tokenizer):
    text_only = Scheduler(tiny_model(NAME), num_slots=2, max_len=MAX_LEN)
    png = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot really").decode()
    npy_float = npy_data_url(np.zeros((8, 8, 3), np.float32))

    async def go(sched, url, role="user"):
        async with serving(sched, tokenizer) as (server, client, logs, _):
            messages = _messages(url)
            messages[0]["role"] = role
            return await post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})

    for url in ("https://example.com/cat.png", "http://127.0.0.1/x.png", "file:///etc/passwd"):
        status, body = asyncio.run(go(image_scheduler, url))
        assert status == 400 and body["error"]["message"] == DATA_URL_ONLY
    status, body = asyncio.run(go(text_only, npy_data_url(_image(0))))
    assert status == 400 and body["error"]["message"] == "this model has no vision tower"
    status, body = asyncio.run(go(image_scheduler, npy_float))
    assert status == 400 and "must be uint8" in body["error"]["message"]
    status, body = asyncio.run(go(image_scheduler, npy_data_url(_image(0)), role="system"))
    assert status == 400 and "only accepted in user messages" in body["error"]["message"]
    status, body = asyncio.run(go(image_scheduler, png))
    assert status == 400 and ("needs Pillow" in body["error"]["message"] or "cannot decode" in
                              body["error"]["message"])
    with pytest.raises(ValueError, match="this model has no vision tower"):
        text_only.validate(Request("x", [1, PLACEHOLDER], 2, images=(prepare_image(_image(0), TINY_VISION_CFG),)))
    with pytest.raises(ValueError, match="6 tokens but 1 placeholder"):
        image_scheduler.validate(Request("x", [1, PLACEHOLDER], 2,
                                         images=(prepare_image(_image(0), TINY_VISION_CFG),)))


TINY_VISION_CFG = VisionConfig(**TINY_VISION, text_hidden_size=64)


def test_data_urls_decode_npy_and_refuse_other_schemes_and_types():
    image = _image(3)
    np.testing.assert_array_equal(decode_data_url(npy_data_url(image)), image)
    for url, msg in (("https://x/y.png", DATA_URL_ONLY), ("data:text/plain;base64,aGk=", "not supported"),
                     ("data:application/x-npy,xyz", "only base64"), ("data:application/x-npy;base64,!!", "invalid"),
                     ("data:application/x-npy;base64," + base64.b64encode(b"junk").decode(), "not a valid .npy")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            decode_data_url(url)
    a, b = prepare_image(image, TINY_VISION_CFG), prepare_image(image.copy(), TINY_VISION_CFG)
    assert a.digest == b.digest != prepare_image(_image(4), TINY_VISION_CFG).digest


def test_image_warm_up_compiles_the_tower_and_its_prefill(image_scheduler):
    """Warm-up's image part (`image_plan` + `run_image_plan`, as `warm_up(every_bucket=False)` runs it): the tower
    and the prefill of the warm-up image (1024 px halved until it fits: 16 px, 8 x 8 patches here); that request
    then compiles nothing. The full plan puts the warm-up image in a prompt of every length bucket."""
    logs: list[str] = []
    run_image_plan(image_scheduler, image_plan(image_scheduler, every_bucket=False), logs.append)
    image = warm_up_image(image_scheduler)
    assert image.grid == (1, 8, 8) and image.num_tokens == 16
    assert len(logs) == 1 and logs[0].startswith(
        "warm-up 1/1: vision tower for a 8 x 8-patch image (16 tokens) and its prefill compiled")
    traces = dict(TRACE_COUNTS)
    image_scheduler.generate([Request("r", [PLACEHOLDER] * 16, 1, eos_ids=[], images=(image,))])  # decode: text's
    assert dict(TRACE_COUNTS) == traces, "the warm-up image compiled a program after warm-up"
    plan = image_plan(image_scheduler, every_bucket=True)
    assert [(len(ids), im.num_tokens, ids.count(PLACEHOLDER)) for _, ids, im in plan] == [
        (16, 16, 16), (16, 16, 16), (17, 16, 16), (33, 16, 16)]  # buckets 16, 32, 64 of max_len 64


@pytest.mark.slow  # ~70 s: every prefill bucket, text and image; the test above checks the image part by default
def test_warm_up_compiles_the_image_path(vlm, image_scheduler):
    """After `warm_up` on a server with a vision tower, an image of the warm-up size compiles nothing in a prompt of
    any length bucket (tower, image prefill, decode), and the image prefill of another size compiles only the tower
    for its grid. The first request after warm-up gives the multimodal model's own tokens."""
    text, vision, model = vlm
    logs: list[str] = []
    warm_up(image_scheduler, logs.append)
    image = warm_up_image(image_scheduler)
    assert image.grid == (1, 8, 8) and image.num_tokens == 16  # 1024 px halved to 16 px: 16 tokens < max_len 64
    assert any("vision tower for a 8 x 8-patch image (16 tokens)" in m for m in logs)
    assert sum("image prefill of" in m for m in logs) == 3  # prompt buckets 16, 32, 64
    traces = dict(TRACE_COUNTS)
    requests = [Request(f"r{n}", [1] * n + [PLACEHOLDER] * 16, 3, eos_ids=[], images=(image,)) for n in (0, 5, 30)]
    got = image_scheduler.generate(requests)
    assert dict(TRACE_COUNTS) == traces, "an image request compiled a program after warm-up"
    assert got["r5"][0] == direct_greedy(model, [1] * 5 + [PLACEHOLDER] * 16, np.zeros((16, 16, 3), np.uint8), 3)
    other = prepare_image(_image(5), vision.cfg)  # another grid: only the tower compiles
    image_scheduler.generate([Request("o", [1] * 3 + [PLACEHOLDER] * other.num_tokens, 2, eos_ids=[],
                                      images=(other,))])
    assert {k: v - traces.get(k, 0) for k, v in TRACE_COUNTS.items() if v != traces.get(k, 0)} == {
        "vision_encode": 1}


@pytest.mark.slow  # ~35 s; video chunks are checked against transformers and the float64 reference by default
def test_video_chunks_through_the_scheduler_equal_the_multimodal_model(vlm, image_scheduler):
    """A 6-frame video as two chunks (`prepare_video`: 4 + 2 frames, 4 tokens each) in one request: the scheduler's
    tokens equal the multimodal model's full forwards over the packed chunks."""
    _, vision, model = vlm
    frames = [np.random.RandomState(20 + i).randint(0, 256, (8, 8, 3)).astype(np.uint8) for i in range(6)]
    chunks = prepare_video(frames, vision.cfg)
    assert [(c.grid, c.num_tokens) for c in chunks] == [((4, 4, 4), 4), ((2, 4, 4), 4)]
    ids = [1, 2] + [PLACEHOLDER] * 4 + [3] + [PLACEHOLDER] * 4 + [4, 5]
    want = direct_greedy(model, ids, chunks, N_NEW)
    got = image_scheduler.generate([Request("v", ids, N_NEW, eos_ids=[], images=chunks)])["v"][0]
    assert got == want
    assert want != direct_greedy(model, ids, prepare_video(frames[:4] + frames[5:] + frames[4:5], vision.cfg),
                                 N_NEW)  # frame order within a chunk matters (time sinusoid)

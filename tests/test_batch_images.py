"""Images in batch mode (`serve.py --prompts_file`): a `.jsonl` chat record whose image parts name local files gives
the same greedy tokens as the same conversation with the image as a data URL through /v1/chat/completions (and as
the multimodal model's own full forwards); missing, unreadable and remote images are errors naming the record and
the file."""

from __future__ import annotations

import asyncio
import json

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.inference.batch import BatchOptions, read_prompts, run_batch
from k3jax.inference.batch_chat import NO_FETCH
from k3jax.inference.chat import load_chat_template
from k3jax.inference.engine import Engine
from k3jax.inference.images import load_image_url, npy_data_url, prepare_image
from k3jax.inference.openai_api import image_parts, parse_chat
from k3jax.inference.scheduler import Request, Scheduler
from k3jax.vision import K3VisionLanguageModel, VisionConfig
from tests.test_image_serving import MAX_LEN, N_NEW, PLACEHOLDER, _image, _messages, direct_greedy
from tests.test_inference_cache import tiny_model
from tests.test_multimodal_model import TINY_VISION, _random_vision
from tests.test_server import NAME, post, serving


@pytest.fixture(scope="module")
def models():
    text = tiny_model(NAME)
    vision, _ = _random_vision(VisionConfig(**TINY_VISION, text_hidden_size=text.cfg.hidden_size), jnp.float32)
    return text, vision


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _opts(prompts: str, out, **kw) -> BatchOptions:
    return BatchOptions(config=NAME, prompts_file=prompts, out=str(out), max_new_tokens=N_NEW, max_len=MAX_LEN,
                        image_placeholder_id=PLACEHOLDER, **kw)


def test_batch_image_record_gives_the_chat_path_tokens(models, tokenizer, tmp_path):
    """The server's chat path without HTTP: the data URL decoded (`load_image_url`), the conversation encoded with
    its placeholders, one scheduler request; a scheduler of the batch's shape shares its compiled programs."""
    text, vision = models
    np.save(tmp_path / "a.npy", _image(2))
    recs = run_batch(_opts(_write(tmp_path / "p.jsonl", [{"messages": _messages("a.npy")}]), tmp_path / "o.jsonl"),
                     log=lambda m: None, model=text, vision=vision)
    url = npy_data_url(_image(2))
    parsed = parse_chat({"messages": _messages(url)})
    images = tuple(load_image_url(p.url, vision.cfg) for p in image_parts(parsed.messages))
    ids = load_chat_template(tokenizer, None).encode(parsed.messages, [[PLACEHOLDER] * im.num_tokens
                                                                       for im in images])
    sched = Scheduler(text, num_slots=1, max_len=len(ids) + N_NEW - 1)
    sched.attach_vision(vision, PLACEHOLDER)
    eos = [text.cfg.eos_token_id]
    want = sched.generate([Request("r", ids, N_NEW, eos_ids=eos, images=images)])["r"]
    assert (recs[0]["completion_ids"], recs[0]["finish_reason"]) == want and recs[0]["prompt_tokens"] == len(ids)
    other = sched.generate([Request("r", ids, N_NEW, eos_ids=eos, images=(load_image_url(npy_data_url(
        _image(3)), vision.cfg),))])["r"]
    assert other[0] != want[0]  # the image matters


@pytest.mark.slow  # ~45 s: three sets of compiles; the chat-path test above checks the same tokens by default
def test_batch_image_record_gives_the_chat_api_tokens(models, tokenizer, tmp_path):
    text, vision = models
    (tmp_path / "imgs").mkdir()
    im_a, im_b = _image(0), _image(1)
    np.save(tmp_path / "imgs" / "a.npy", im_a)
    np.save(tmp_path / "b.npy", im_b)
    prompts = _write(tmp_path / "p.jsonl", [
        {"prompt": "def f(x):", "id": "text"},
        {"messages": _messages("imgs/a.npy"), "id": "a"},  # relative to the prompts file
        {"messages": _messages(f"file://{tmp_path / 'b.npy'}"), "id": "b"}])
    recs = run_batch(_opts(prompts, tmp_path / "out.jsonl", batch_size=2), log=lambda m: None, model=text,
                     vision=vision)
    assert [r.get("id") for r in recs] == ["text", "a", "b"]

    sched = Scheduler(text, num_slots=2, max_len=MAX_LEN)
    sched.attach_vision(vision, PLACEHOLDER)

    async def go():
        async with serving(sched, tokenizer, max_queue=4) as (server, client, logs, _):
            return await asyncio.gather(*[post(client, "/v1/chat/completions", {
                "messages": _messages(npy_data_url(im)), "max_tokens": N_NEW, "temperature": 0})
                for im in (im_a, im_b)])

    model = K3VisionLanguageModel(text, vision, placeholder_id=PLACEHOLDER)
    eos = text.cfg.eos_token_id
    for rec, im, (status, body) in zip(recs[1:], (im_a, im_b), asyncio.run(go())):
        assert status == 200, body
        assert rec["completion"] == body["choices"][0]["message"]["content"]
        assert rec["completion_tokens"] == body["usage"]["completion_tokens"]
        assert rec["prompt_tokens"] == body["usage"]["prompt_tokens"]
        want = direct_greedy(model, _ids_of(rec, tokenizer, vision), im, N_NEW)
        assert rec["completion_ids"] == (want[:want.index(eos)] if eos in want else want)
    assert recs[1]["completion_ids"] != recs[2]["completion_ids"]  # the image matters
    want_text = Engine(text).generate([tokenizer.encode("def f(x):", add_bos=True)], N_NEW, eos_id=eos)[0]
    assert recs[0]["completion_ids"] == want_text.tokens  # plain prompts still go through the engine


def _ids_of(rec, tokenizer, vision) -> list[int]:
    """The prompt ids the server builds for `_messages(...)` (the same template and placeholders)."""
    num = prepare_image(_image(0), vision.cfg).num_tokens
    ids = load_chat_template(tokenizer, None).encode(parse_chat({"messages": _messages("data:,")}).messages,
                                                     [[PLACEHOLDER] * num])
    assert len(ids) == rec["prompt_tokens"]
    return ids


def test_batch_image_errors_name_the_record_and_the_file(models, tmp_path):
    text, vision = models
    out = tmp_path / "out.jsonl"
    np.save(tmp_path / "ok.npy", _image(0))
    (tmp_path / "junk.npy").write_bytes(b"\x93NUMPY not really")
    np.save(tmp_path / "float.npy", np.zeros((8, 8, 3), np.float32))
    (tmp_path / "cat.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    ok = {"messages": _messages("ok.npy")}

    def read_error(url, role="user"):
        messages = _messages(url)
        messages[0]["role"] = role
        with pytest.raises(ValueError) as e:
            read_prompts(_write(tmp_path / "p.jsonl", [ok, {"messages": messages}]))
        return str(e.value)

    msg = read_error("missing.png")
    assert msg.startswith(f"{tmp_path / 'p.jsonl'}:2: image file {tmp_path / 'missing.png'}") and "not found" in msg
    assert NO_FETCH in read_error("https://example.com/cat.png")
    assert "p.jsonl:2: " in read_error("ok.npy", role="system") and "only accepted in user messages" in read_error(
        "ok.npy", role="system")

    def run_error(name, **kw):
        prompts = _write(tmp_path / "p.jsonl", [ok, {"prompt": "hi"}, {"messages": _messages(name)}])
        with pytest.raises(ValueError) as e:
            run_batch(_opts(prompts, out, **kw.pop("opts", {})), log=lambda m: None, model=text, **kw)
        return str(e.value)

    where = f"{tmp_path / 'p.jsonl'}:3: image file "
    assert run_error("junk.npy", vision=vision).startswith(where + f"{tmp_path / 'junk.npy'}: image file: not a "
                                                           "valid .npy array")
    assert "must be uint8" in run_error("float.npy", vision=vision)
    msg = run_error("cat.png", vision=vision)
    assert msg.startswith(where + str(tmp_path / "cat.png")) and ("needs Pillow" in msg or "cannot decode" in msg)
    assert "p.jsonl:1: the record has images but the weights have no vision tower" in run_error("ok.npy")
    assert "--novision" in run_error("ok.npy", vision=vision, opts=dict(vision=False))
    assert not out.exists()  # nothing generated or written

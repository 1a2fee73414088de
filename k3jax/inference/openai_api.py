"""OpenAI-compatible request validation and response bodies (pure functions; the HTTP side is `server.py`).

Accepted fields — /v1/completions: model, prompt (a string or a non-empty list of token ids), max_tokens (default
16), temperature (default 1, as OpenAI), top_p, top_k (0 = off), n (choices, 1..MAX_CHOICES: independent
generations of the prompt; with a seed, choice 0 draws as the same request with n 1 and choice i from
fold_in(seed's key, i)), echo (the prompt text before each choice's text), stream, stream_options
({"include_usage": bool}), stop (a string or up to 4), seed, user, logprobs (null, or an integer k in
[0, MAX_LOGPROBS]: each generated token's log-probability and its k most likely alternatives, the legacy format
{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}; not with echo: prompt log-probabilities
are not computed).
/v1/chat/completions: the same without echo, with messages ([{role: system|user|assistant, content: string or
[{type: "text", text}, {type: "image_url", image_url: {url: "data:...", detail}} (user messages; data URLs only,
any other URL is refused: no network fetches), ...]}]) instead of prompt and max_tokens / max_completion_tokens
(default: the rest of the context, capped by the server's default_max_tokens), logprobs (a boolean) and
top_logprobs (an integer in [0, MAX_LOGPROBS], only with logprobs true): choices[i].logprobs = {content: [{token,
logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], refusal: null}.
Log-probabilities are log-softmax of the model's raw logits, before temperature / top_k / top_p (the model's own
distribution, as OpenAI reports it); a streamed chunk carries the entries of the tokens whose text it sends; tokens
cut by a stop string are left out with their text.
Fields that clients send with a neutral default (`NEUTRAL`: frequency_penalty 0, presence_penalty 0, logit_bias {},
best_of 1, tools [], ...) are accepted with that value or null; any other value is rejected with 400 naming the
field (code "unsupported_value"): penalties, logit biases and tools are not implemented. Unknown fields are
rejected with 400 naming the field.

finish_reason: "stop" (EOS or a stop string), "length" (max_tokens), "cancelled" (the server shut down or dropped
the request before it finished; streaming only — a non-streaming request gets 503 instead).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from k3jax.inference.chat import ROLES
from k3jax.inference.engine import SamplingParams
from k3jax.inference.images import DATA_URL_ONLY
from k3jax.inference.slot_steps import MAX_TOP_LOGPROBS


def _eq(*values):
    """Accepts exactly these values (numbers by value, but never a boolean for a number)."""
    return lambda v: any(type(v) is type(x) or (_is_number(v) and _is_number(x)) for x in values) and v in values


# field -> (accepts the value, what is accepted): neutral defaults of features this server does not implement
NEUTRAL_COMMON = {
    "frequency_penalty": (_eq(0), "0"), "presence_penalty": (_eq(0), "0"), "repetition_penalty": (_eq(1), "1"),
    "min_p": (_eq(0), "0"), "logit_bias": (lambda v: v == {}, "{}"),
}
NEUTRAL_COMPLETION = {**NEUTRAL_COMMON, "best_of": (_eq(1), "1"),
                      "suffix": (_eq(""), '""')}
NEUTRAL_CHAT = {
    **NEUTRAL_COMMON,
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}'), "tools": (_eq([]), "[]"),
    "tool_choice": (_eq("none", "auto"), '"none" or "auto"'), "parallel_tool_calls": (_eq(True, False), "a boolean"),
    "functions": (_eq([]), "[]"), "function_call": (_eq("none", "auto"), '"none" or "auto"'),
    "store": (_eq(False), "false"), "service_tier": (_eq("auto", "default"), '"auto" or "default"'),
    "metadata": (lambda v: isinstance(v, dict), "an object"), "modalities": (_eq(["text"]), '["text"]'),
}
COMMON_FIELDS = {"model", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop", "seed", "user"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "max_tokens", "echo", "logprobs"} | set(NEUTRAL_COMPLETION)
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"} | set(
    NEUTRAL_CHAT)
MAX_STOP_STRINGS = 4
MAX_CHOICES = 16
MAX_LOGPROBS = MAX_TOP_LOGPROBS  # alternatives per token (the engine computes this many on the device)
DEFAULT_COMPLETION_MAX_TOKENS = 16


class ApiError(Exception):
    """A client error: HTTP `status` with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class ParsedRequest:
    """A validated request: either `prompt` (text or ids) or `messages`; max_tokens None = the endpoint default."""

    prompt: str | list[int] | None
    messages: list[dict] | None
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    seed: int | None
    model: str | None
    n: int = 1  # choices
    echo: bool = False  # completions: the prompt text before each choice's text
    logprobs: int | None = None  # None: no log-probabilities; k: each token's and its top k alternatives'


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A finite float or an int of at most 2**53 in magnitude (never a bool; no OverflowError for huge ints)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return math.isfinite(v) if isinstance(v, float) else abs(v) <= 2 ** 53


def _bad(msg: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, msg, param, code)


def _check_fields(body, allowed: set[str], neutral: dict) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unknown or unsupported field(s): {', '.join(unknown)}", unknown[0], "unknown_field")
    for name, (accepts, what) in neutral.items():
        v = body.get(name)
        if v is not None and not accepts(v):
            raise ApiError(400, f"'{name}' is not supported here: only {what} (or null) is accepted, got {v!r}", name,
                           "unsupported_value")


def _optional(body: dict, name: str, check, what: str, default=None):
    if name not in body or body[name] is None:
        return default
    v = body[name]
    if not check(v):
        raise _bad(f"'{name}' must be {what}, got {v!r}", name, "invalid_type" if not _type_ok(v, what) else
                   "invalid_value")
    return v


def _type_ok(v, what: str) -> bool:
    if "integer" in what:
        return _is_int(v)
    if "number" in what:
        return _is_number(v)
    if "boolean" in what:
        return isinstance(v, bool)
    if "string" in what:
        return isinstance(v, str)
    return True


def _common(body: dict) -> dict:
    temperature = _optional(body, "temperature", lambda v: _is_number(v) and v >= 0, "a number >= 0", 1.0)
    top_p = _optional(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)
    top_k = _optional(body, "top_k", lambda v: _is_int(v) and 0 <= v < 2 ** 31, "an integer >= 0 (0 = off), < 2**31",
                      0)
    n = _optional(body, "n", lambda v: _is_int(v) and 1 <= v <= MAX_CHOICES, f"an integer in [1, {MAX_CHOICES}]",
                  1)
    stream = _optional(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise _bad("'stream_options' is only allowed with stream: true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"} or not isinstance(
                opts.get("include_usage", False), bool):
            raise _bad("'stream_options' must be {\"include_usage\": boolean}", "stream_options", "invalid_type")
        include_usage = opts.get("include_usage", False)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
            and len(stop) <= MAX_STOP_STRINGS):
        raise _bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings",
                   "stop", "invalid_type")
    seed = _optional(body, "seed", _is_int, "an integer")
    model = _optional(body, "model", lambda v: isinstance(v, str), "a string")
    _optional(body, "user", lambda v: isinstance(v, str), "a string")
    sampling = SamplingParams(float(temperature), int(top_k), float(top_p))
    return dict(sampling=sampling, stop=list(stop), stream=stream, include_usage=include_usage, seed=seed,
                model=model, n=n)


def _max_tokens(body: dict, names: tuple[str, ...]):
    value = None
    for name in names:
        v = _optional(body, name, lambda v: _is_int(v) and v >= 1, "an integer >= 1")
        if v is not None:
            value = v
    return value


def parse_completion(body) -> ParsedRequest:
    """Validates a /v1/completions body; raises ApiError(400) naming the first problem."""
    _check_fields(body, COMPLETION_FIELDS, NEUTRAL_COMPLETION)
    if "prompt" not in body:
        raise _bad("'prompt' is required", "prompt", "missing_field")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        pass
    elif isinstance(prompt, list) and prompt and all(_is_int(i) for i in prompt):
        prompt = list(prompt)
    else:
        raise _bad("'prompt' must be a string or a non-empty list of token ids (one prompt per request)",
                   "prompt", "invalid_type")
    max_tokens = _max_tokens(body, ("max_tokens",))
    echo = _optional(body, "echo", lambda v: isinstance(v, bool), "a boolean", False)
    logprobs = _optional(body, "logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
                         f"an integer in [0, {MAX_LOGPROBS}]")
    if logprobs is not None and echo:
        raise _bad("'logprobs' with 'echo' is not supported (prompt log-probabilities are not computed)", "logprobs",
                   "unsupported_value")
    return ParsedRequest(prompt=prompt, messages=None,
                         max_tokens=DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens, echo=echo,
                         logprobs=logprobs, **_common(body))


class ImagePart(NamedTuple):
    """An image of a chat message's content (a data URL, decoded by the server)."""

    url: str


def _content_parts(parts: list, where: str, role: str) -> str | list:
    """A content list -> its text (text parts only) or a list of text strings and `ImagePart`s."""
    out: list = []
    for j, p in enumerate(parts):
        at = f"{where}.content[{j}]"
        if isinstance(p, dict) and p.get("type") == "text" and set(p) == {"type", "text"} and isinstance(
                p["text"], str):
            out.append(p["text"])
        elif isinstance(p, dict) and p.get("type") == "image_url" and set(p) == {"type", "image_url"}:
            image = p["image_url"]
            if not (isinstance(image, dict) and isinstance(image.get("url"), str) and set(image) <= {"url", "detail"}
                    and image.get("detail", "auto") in ("auto", "low", "high")):
                raise _bad(f"{at}.image_url must be {{\"url\": string, \"detail\": \"auto\"|\"low\"|\"high\" "
                           "(optional)}", at, "invalid_type")
            if not image["url"].startswith("data:"):
                raise _bad(DATA_URL_ONLY, at)
            if role != "user":
                raise _bad(f"{at}: image parts are only accepted in user messages", at)
            out.append(ImagePart(image["url"]))
        else:
            raise _bad(f"{at} must be a text part {{\"type\": \"text\", \"text\": ...}} or an image part "
                       "{\"type\": \"image_url\", \"image_url\": {\"url\": \"data:...\"}}", at, "invalid_type")
    if all(isinstance(p, str) for p in out):
        return "".join(out)
    return out


def image_parts(messages: list[dict]) -> list[ImagePart]:
    """The images of parsed messages, in order."""
    return [p for m in messages if isinstance(m["content"], list) for p in m["content"] if isinstance(p, ImagePart)]


def parse_chat(body) -> ParsedRequest:
    """Validates a /v1/chat/completions body; raises ApiError(400) naming the first problem."""
    _check_fields(body, CHAT_FIELDS, NEUTRAL_CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise _bad(f"{where} must be an object with 'role' and 'content' (and optional 'name')", where,
                       "invalid_type")
        if m.get("role") not in ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, got {m.get('role')!r}", where)
        content = m.get("content")
        if isinstance(content, list):
            content = _content_parts(content, where, m["role"])
        if not isinstance(content, (str, list)):
            raise _bad(f"{where}.content must be a string or a list of text and image_url parts", where,
                       "invalid_type")
        out.append({"role": m["role"], "content": content})
    max_tokens = _max_tokens(body, ("max_tokens", "max_completion_tokens"))
    want = _optional(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
    top = _optional(body, "top_logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
                    f"an integer in [0, {MAX_LOGPROBS}]", 0)
    if top and not want:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return ParsedRequest(prompt=None, messages=out, max_tokens=max_tokens, logprobs=top if want else None,
                         **_common(body))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class LogprobEntry(NamedTuple):
    """One generated token's log-probabilities: `offset` = characters of the choice's text before it."""

    offset: int
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def completion_logprobs(entries: list[LogprobEntry], decode) -> dict:
    """The legacy completions format; `decode(id)` is a token's text (alternatives with the same text share a key)."""
    return {"tokens": [decode(e.token) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode(t): v for t, v in e.top} for e in entries],
            "text_offset": [e.offset for e in entries]}


def chat_logprobs(entries: list[LogprobEntry], decode) -> dict:
    """The chat format: {content: [{token, logprob, bytes, top_logprobs}], refusal: null} (bytes: UTF-8 of the
    token's text)."""
    def one(token: int, logprob: float) -> dict:
        text = decode(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
                        for e in entries], "refusal": None}


def completion_body(rid: str, created: int, model: str, choices: list[tuple], use: dict) -> dict:
    """`choices`: (text, finish_reason[, logprobs object or None]) per choice, in index order."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": c[0], "logprobs": c[2] if len(c) > 2 else None, "finish_reason": c[1]}
                        for i, c in enumerate(choices)], "usage": use}


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None, index: int = 0,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_body(rid: str, created: int, model: str, choices: list[tuple], use: dict) -> dict:
    """`choices`: (text, finish_reason[, logprobs object or None]) per choice, in index order."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c[0]},
                         "logprobs": c[2] if len(c) > 2 else None, "finish_reason": c[1]}
                        for i, c in enumerate(choices)], "usage": use}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None, index: int = 0,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


class TextAssembler:
    """Token ids → text deltas that are safe to send: holds back an incomplete UTF-8 tail (decoded as U+FFFD) and
    any tail that could begin a stop string; ends the text before the first stop string."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already returned
        self.stopped = False
        self.text = ""
        self.full = ""  # the decoded text of every id so far (stop strings included)
        self.offsets: list[int] = []  # per token: characters of the full text before it

    def add(self, token: int) -> str:
        self.offsets.append(len(self.full))
        self.ids.append(int(token))
        return self._advance(final=False)

    def finish(self) -> str:
        """The rest of the text at the end of generation."""
        return "" if self.stopped else self._advance(final=True)

    def _advance(self, final: bool) -> str:
        text = self.full = self.tokenizer.decode(self.ids)
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, self.sent - longest + 1)
        hits = [p for p in (text.find(s, start) for s in self.stop) if p >= 0]
        if hits:
            end = min(hits)
            self.stopped = True
        else:
            end = len(text)
            if not final:
                if text.endswith("\ufffd"):
                    end -= 1
                hold = 0  # a tail that is a proper prefix of a stop string may still become one
                for s in self.stop:
                    for k in range(min(len(s) - 1, end), 0, -1):
                        if text[end - k:end] == s[:k]:
                            hold = max(hold, k)
                            break
                end -= hold
        end = max(end, self.sent)
        delta = text[self.sent:end]
        self.sent = end
        self.text = text[:end]
        return delta

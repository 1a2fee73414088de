"""Chat prompts: messages → token ids, plus the extra ids that end an assistant turn.

Byte tokenizer (tiny configs) — a fixed, documented template (plain UTF-8 text, BOS first):

    <BOS><|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ... <|assistant|>\\n

one `<|{role}|>\\n{content}\\n` block per message, then `<|assistant|>\\n` to open the reply. The reply ends at the
EOS id (or max_tokens / a stop string). With the byte tokenizer the tags are ordinary bytes, not special ids.

HF directories whose `tokenizer_config.json` carries a Jinja `chat_template` (and jinja2 installed): that template,
rendered with `messages`, `add_generation_prompt=True` and the tokenizer's bos/eos strings; `<|im_end|>` (when the
tokenizer has it) also ends the turn. Otherwise the byte-style template above is encoded with the tokenizer (plain
text).

Images (`encode(messages, image_ids)`): a message's content may be a list of text and image slots; each image slot
becomes its placeholder ids (one per image token) right where it stands in the rendered text, outside any text
encoding; no media start/end tokens are added around them.

Special tokens come only from the template itself: message content is encoded as plain text, so a user who writes
"<|im_end|><|im_start|>system" gets those characters, not turn or role tokens. The template is rendered with each
content wrapped in per-call random markers; the text between markers is encoded as ordinary text, the rest with
special tokens allowed. A template that cuts into the markers (it rewrites content) is rendered with the real
content instead, and a conversation whose content holds special-token text is then refused (ValueError).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from typing import Sequence

ROLES = ("system", "user", "assistant")
TURN_END_TOKENS = ("<|im_end|>",)


class ChatTemplate:
    """`encode(messages) -> ids`; `stop_ids`: ids (besides the config's EOS) that end the assistant's turn."""

    def __init__(self, tokenizer, jinja_template: str | None = None, special_strings: dict | None = None):
        self.tokenizer = tokenizer
        self.stop_ids: tuple[int, ...] = ()
        self._jinja = None
        self._special = dict(special_strings or {})
        if jinja_template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._jinja = env.from_string(jinja_template)
            encoding = getattr(tokenizer, "encoding", None)
            specials = getattr(encoding, "_special_tokens", {}) if encoding is not None else {}
            self.stop_ids = tuple(specials[t] for t in TURN_END_TOKENS if t in specials)

    @property
    def name(self) -> str:
        return "tokenizer_config.json chat_template" if self._jinja is not None else "k3jax byte chat template"

    def render(self, messages: list[dict]) -> str:
        """The prompt text (without BOS for the built-in template: `encode` adds it)."""
        if self._jinja is not None:
            return self._jinja.render(messages=messages, add_generation_prompt=True, **self._special)
        parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        return "".join(parts) + "<|assistant|>\n"

    def encode(self, messages: list[dict], image_ids: Sequence[Sequence[int]] = ()) -> list[int]:
        """Token ids of the conversation. A message's content may be a list of text strings and image slots (any
        non-string item): the k-th image slot becomes image_ids[k] (its placeholder ids) where it stands."""
        mark = f"\x02{secrets.token_hex(8)}img\x03"
        slots = [p for m in messages if isinstance(m["content"], list) for p in m["content"] if not isinstance(p, str)]
        if len(slots) != len(image_ids):
            raise ValueError(f"{len(slots)} image part(s) but {len(image_ids)} image id list(s)")
        messages = [{**m, "content": "".join(p if isinstance(p, str) else mark for p in m["content"])}
                    if isinstance(m["content"], list) else m for m in messages]
        images = iter(image_ids)
        placed = 0

        def plain(text: str, encode) -> list[int]:  # text with image marks -> ids, images in place of the marks
            nonlocal placed
            ids: list[int] = []
            for i, piece in enumerate(text.split(mark)):
                if i:
                    ids += [int(t) for t in next(images)]
                    placed += 1
                ids += encode(piece, i == 0)
            return ids

        ids = self._encode(messages, plain, bool(image_ids))
        if placed != len(image_ids):
            raise ValueError(f"the chat template kept {placed} of the {len(image_ids)} image(s)")
        return ids

    def _encode(self, messages: list[dict], plain, images: bool) -> list[int]:
        encoding = getattr(self.tokenizer, "encoding", None)
        if self._jinja is None or encoding is None:  # no special-token strings: all plain text
            add_bos = self._jinja is None
            return plain(self.render(messages), lambda t, first: self.tokenizer.encode(t, add_bos=add_bos and first))
        nonce = secrets.token_hex(8)
        start, end = f"\x02{nonce}\x03", f"\x02/{nonce}\x03"
        text = self.render([{**m, "content": f"{start}{m['content']}{end}"} for m in messages])
        parts = re.split(f"{re.escape(start)}(.*?){re.escape(end)}", text, flags=re.DOTALL)
        if not any(nonce in p for p in parts[::2]):  # even parts: template text; odd parts: message content
            ids: list[int] = []
            for i, part in enumerate(parts):
                ids += encoding.encode(part, allowed_special="all") if i % 2 == 0 else plain(
                    part, lambda t, first: encoding.encode_ordinary(t))
            return ids
        if images:
            raise ValueError("this chat template rewrites message content: images cannot be placed in it")
        text = self.render(messages)  # the template rewrote content: it must not hold special-token text
        for m in messages:
            found = [t for t in encoding.special_tokens_set if t in m["content"]]
            if found:
                raise ValueError(f"message content holds the special token {found[0]!r}, which this chat template "
                                 "cannot keep apart from its own")
        return encoding.encode(text, allowed_special="all")


def _raise(message):
    raise ValueError(message)


def load_chat_template(tokenizer, directory: str | None) -> ChatTemplate:
    """The directory's Jinja chat template when it has one and jinja2 is installed, else the built-in template."""
    if directory:
        for d in (directory, os.path.join(directory, "tokenizer")):
            path = os.path.join(d, "tokenizer_config.json")
            if not os.path.isfile(path):
                continue
            with open(path, encoding="utf-8") as f:
                tok_cfg = json.load(f)
            template = tok_cfg.get("chat_template")
            if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
            if isinstance(template, str):
                try:
                    import jinja2  # noqa: F401
                except ImportError:
                    break
                special = {k: _token_str(tok_cfg.get(k)) for k in ("bos_token", "eos_token")}
                return ChatTemplate(tokenizer, template, {k: v for k, v in special.items() if v is not None})
    return ChatTemplate(tokenizer)


def _token_str(value):
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None

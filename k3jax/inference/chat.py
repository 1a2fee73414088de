"""Chat prompts: messages → token ids, plus the extra ids that end an assistant turn.

Byte tokenizer (tiny configs) — a fixed, documented template (plain UTF-8 text, BOS first):

    <BOS><|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ... <|assistant|>\\n

one `<|{role}|>\\n{content}\\n` block per message, then `<|assistant|>\\n` to open the reply. The reply ends at the
EOS id (or max_tokens / a stop string). With the byte tokenizer the tags are ordinary bytes, not special ids.

HF directories whose `tokenizer_config.json` carries a Jinja `chat_template` (and jinja2 installed): that template,
rendered with `messages`, `add_generation_prompt=True` and the tokenizer's bos/eos strings, encoded with special
tokens allowed; `<|im_end|>` (when the tokenizer has it) also ends the turn. Otherwise the byte-style template above
is encoded with the tokenizer (plain text).
"""

from __future__ import annotations

import json
import os

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

    def encode(self, messages: list[dict]) -> list[int]:
        text = self.render(messages)
        if self._jinja is not None:
            encoding = getattr(self.tokenizer, "encoding", None)
            if encoding is not None:  # tiktoken: the template's special tokens map to their ids
                return encoding.encode(text, allowed_special="all")
            return self.tokenizer.encode(text, add_bos=False)
        return self.tokenizer.encode(text, add_bos=True)


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

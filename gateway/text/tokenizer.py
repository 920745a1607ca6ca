"""A torch-free tokenizer: `tokenizers` for tokenize/decode, jinja2 for the chat template.

Reads a Hugging Face model directory (tokenizer.json, tokenizer_config.json and an optional
chat_template.jinja) the way `transformers` would, without importing it (it imports torch)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# Names the gateway passes to every chat template: `chat_template_kwargs` may not override them.
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                    "raise_exception", "strftime_now"})
# Past these sizes encode/decode go through the batch calls, which release the GIL.
_RELEASE_GIL_CHARS = 1 << 14
_RELEASE_GIL_TOKENS = 1 << 12


class TemplateError(ValueError):
    """The chat template refused the conversation (raise_exception in the template)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _model_vocab_size(config_path: Path) -> int:
    """`vocab_size` of the model's config.json (top level or `text_config`); 0 when absent."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return 0
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else 0


class ModelTokenizer:
    """Tokenizer and chat template of one model directory."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        template_path = path / "chat_template.jinja"
        template = template_path.read_text() if template_path.exists() else config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos = bool(config.get("add_bos_token", False))
        self.model_vocab_size = _model_vocab_size(path / "config.json")
        self._compiled: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        """Token ids the model accepts: its embedding rows (config.json), which are often more
        than the tokenizer's entries (padded vocabularies), else the tokenizer's size."""
        return max(self.model_vocab_size, int(self.tokenizer.get_vocab_size(with_added_tokens=True)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; a large text is encoded with the GIL released (`encode_batch`
        releases it, `encode` does not), so other threads and the event loop run meanwhile."""
        if len(text) >= _RELEASE_GIL_CHARS:
            encoded = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            encoded = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        ids = list(encoded.ids)
        bos_id = self.tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        if add_special_tokens and self.add_bos and bos_id is not None and ids[:1] != [bos_id]:
            ids.insert(0, bos_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; a long list is decoded with the GIL released (as `encode`)."""
        if len(ids) >= _RELEASE_GIL_TOKENS:
            return str(self.tokenizer.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0])
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """Text of one token for logprobs (may contain U+FFFD for partial UTF-8)."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself (it reads the variable)."""
        if not self.chat_template:
            return False
        try:
            return "tools" in jinja2.meta.find_undeclared_variables(self._environment().parse(self.chat_template))
        except jinja2.TemplateError:
            return False

    def _environment(self) -> ImmutableSandboxedEnvironment:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_args: dict[str, Any] | None = None) -> str:
        """Render the conversation; raises TemplateError when there is no template, when
        `template_args` names a RESERVED_TEMPLATE_ARGS entry, or when the template fails on this input."""
        extra = dict(template_args or {})
        clash = sorted(RESERVED_TEMPLATE_ARGS & extra.keys())
        if clash:
            raise TemplateError(f"template arguments may not set {clash}")
        if self._compiled is None:
            if not self.chat_template:
                raise TemplateError("this model has no chat template; use /v1/completions")
            try:
                self._compiled = self._environment().from_string(self.chat_template)
            except jinja2.TemplateError as exc:
                raise TemplateError(f"the model's chat template does not compile: {exc}") from exc
        if tools is not None:
            extra["tools"] = tools
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except TemplateError:
            raise
        except RecursionError as exc:
            raise TemplateError("chat template failed: input nests too deeply") from exc
        except Exception as exc:  # whatever the template does with user input is the input's fault
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc

    def render_with_answer_prefix(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                                  template_args: dict[str, Any] | None = None) -> tuple[str, str]:
        """The prompt, and the text the template appends to the conversation for the answer (such
        as ``<|im_start|>assistant\n``, maybe opening or closing a think block): the whole prompt
        when the conversation rendered without it is not a prefix of the prompt."""
        prompt = self.apply_chat_template(messages, True, tools, template_args)
        try:
            before = self.apply_chat_template(messages, False, tools, template_args)
        except TemplateError:  # some templates insist on ending with a user turn
            return prompt, prompt
        return prompt, prompt[len(before):] if prompt.startswith(before) else prompt

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_args: dict[str, Any] | None = None, add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids of a conversation (the template already holds special tokens)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_args)
        return self.encode(text, add_special_tokens=False)

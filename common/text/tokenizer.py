"""Text <-> token ids and chat templates for a model directory, without torch or transformers.

Reads what a Hugging Face tokenizer directory holds: tokenizer.json (the `tokenizers` pipeline),
tokenizer_config.json (named special tokens, chat_template), special_tokens_map.json (fills named
tokens the config lacks), chat_template.jinja and additional_chat_templates/*.jinja (transformers
5 layout), generation_config.json (extra EOS ids). Encoding, decoding and chat rendering match
transformers' AutoTokenizer for tokenizers-backed models. As in transformers 5, tokenizer.json's
post-processor alone decides which special tokens encode() adds (add_bos_token in a config is
ignored). Not reproduced: clean_up_tokenization_spaces (transformers ignores it for BPE models,
which is what served LLMs use) and model-specific tokenizer classes with their own code.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

# The named special tokens transformers exposes to chat templates (its special_tokens_map).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


class Tokenizer:
    def __init__(self, backend: Backend, special_tokens: dict[str, str],
                 chat_templates: dict[str, str], extra_eos_token_ids: tuple[int, ...] = ()) -> None:
        """special_tokens: named token -> text (e.g. "eos_token" -> "</s>"); chat_templates: name
        -> jinja source ("default" is used unless tools are passed and "tool_use" exists)."""
        self._backend = backend
        self.special_tokens = dict(special_tokens)
        self.chat_templates = dict(chat_templates)
        self._compiled: dict[str, jinja2.Template] = {}
        eos = [self.token_to_id(special_tokens["eos_token"])] if "eos_token" in special_tokens else []
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(t for t in (*eos, *extra_eos_token_ids) if t is not None))
        bos = special_tokens.get("bos_token")
        self.bos_token_id: int | None = self.token_to_id(bos) if bos is not None else None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        # The ids decode(skip_special_tokens=True) drops: every added token marked special.
        self.all_special_ids: frozenset[int] = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: a model directory needs a tokenizers-format "
                "tokenizer.json (save one with transformers' tokenizer.save_pretrained)")
        backend = Backend.from_file(str(tokenizer_file))
        config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")
        special_tokens: dict[str, str] = {}
        for name in NAMED_SPECIAL_TOKENS:
            text = _token_text(config.get(name)) or _token_text(special_map.get(name))
            if text:
                special_tokens[name] = text
        generation_eos = _read_json(directory / "generation_config.json").get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        return cls(backend, special_tokens, _chat_templates(directory, config),
                   tuple(generation_eos or ()))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The tokenizer.json pipeline as JSON text (structured outputs read its vocabulary)."""
        return self._backend.to_str()

    def raw_vocab(self) -> dict[str, int]:
        """Every token's raw (pre-decoding) string and its id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render the conversation as the model's chat template does under transformers: messages
        lose their None-valued keys, the named special tokens are template variables, kwargs
        (e.g. documents, enable_thinking) override them."""
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        name = "tool_use" if tools is not None and "tool_use" in self.chat_templates else "default"
        if name not in self.chat_templates:
            raise ValueError("this tokenizer has no chat template" if not self.chat_templates else
                             f"no default chat template among {sorted(self.chat_templates)}")
        template = self._compiled.get(name)
        if template is None:
            template = self._compiled[name] = _environment().from_string(self.chat_templates[name])
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {"documents": None, **self.special_tokens, **kwargs}
        return template.render(**variables, messages=messages, tools=tools,
                               add_generation_prompt=add_generation_prompt)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: str | dict[str, Any] | None) -> str | None:
    # Configs store a special token as its text or as a serialized AddedToken {"content": ...}.
    return value.get("content") if isinstance(value, dict) else value


def _chat_templates(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """Templates by name; files (transformers 5 layout) win over tokenizer_config.json."""
    templates: dict[str, str] = {}
    configured = config.get("chat_template")
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):
        templates.update({t["name"]: t["template"] for t in configured})
    default_file = directory / "chat_template.jinja"
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    return templates


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike jinja2's own tojson: no HTML escaping, non-ASCII kept (as transformers renders it).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace() that refuses underscore names, as transformers' sandbox does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} marks assistant text for transformers' training
    masks; rendering keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    # The same environment transformers gives chat templates: trim/lstrip blocks, loop controls.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env

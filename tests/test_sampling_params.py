import dataclasses

import pytest

from ostinato.sampling_params import SamplingParams

VLLM_DEFAULTS = dict(
    n=1,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    repetition_penalty=1.0,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    seed=None,
    stop=[],
    stop_token_ids=[],
    ignore_eos=False,
    max_tokens=16,
    min_tokens=0,
    logprobs=None,
    skip_special_tokens=True,
    spaces_between_special_tokens=True,
    include_stop_str_in_output=False,
    logit_bias=None,
    prompt_logprobs=None,
    structured_outputs=None,
)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert {f.name: getattr(p, f.name) for f in dataclasses.fields(p)} == VLLM_DEFAULTS
    assert not p.is_greedy


def test_normalization():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_clone_and_replace():
    p = SamplingParams(stop=["x"], stop_token_ids=[3], seed=7)
    q = p.clone()
    assert q == p
    q.stop.append("y")
    q.stop_token_ids.append(4)
    assert p.stop == ["x"] and p.stop_token_ids == [3]
    r = dataclasses.replace(p, temperature=0.5)
    assert r.temperature == 0.5 and r.stop == ["x"] and r.seed == 7
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-1.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be"),
        (dict(presence_penalty=-2.5), "presence_penalty must be in [-2, 2], got -2.5"),
        (dict(presence_penalty=2.1), "presence_penalty must be in [-2, 2]"),
        (dict(frequency_penalty=3.0), "frequency_penalty must be in [-2, 2], got 3.0"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0, got 0.0"),
        (dict(temperature=-1.0), "temperature must be >= 0, got -1.0"),
        (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (dict(top_k=-2), "top_k must be -1, 0 (disabled) or in [1, 2**63 - 1], got -2"),
        (dict(top_k=2**63), "top_k must be -1, 0 (disabled) or in [1, 2**63 - 1]"),
        (dict(top_k=2.5), "top_k must be"),
        (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1"),
        (dict(min_p=1.1), "min_p must be in [0, 1]"),
        (dict(seed=1.5), "seed must be None or an int in [-2**63, 2**63 - 1], got 1.5"),
        (dict(seed=2**63), "seed must be None or an int in [-2**63, 2**63 - 1]"),
        (dict(seed=-(2**63) - 1), "seed must be"),
        (dict(seed="1"), "seed must be"),
        (dict(stop=[""]), "stop must be"),
        (dict(stop=[1]), "stop must be"),
        (dict(stop_token_ids=[1, "2"]), "stop_token_ids must be"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be"),
        (dict(stop_token_ids=[2**70]), "stop_token_ids must be ints in [0, 2**63 - 1]"),
        (dict(logit_bias={5: 101}), "logit_bias: values must be numbers in [-100, 100] (token 5), got 101"),
        (dict(logit_bias={5: float("nan")}), "logit_bias: values must be"),
        (dict(logit_bias={5: "1"}), "logit_bias: values must be"),
        (dict(logit_bias={-1: 1.0}), "logit_bias: keys must be token ids"),
        (dict(logit_bias={"5": 1.0}), "logit_bias: keys must be token ids"),
        (dict(logit_bias=[5]), "logit_bias must be a dict"),
        (dict(structured_outputs={5: 1}), "structured_outputs: the fields are"),
        (dict(structured_outputs={"regexp": "a"}), "structured_outputs: the fields are"),
        (dict(structured_outputs="json"), "structured_outputs must be a StructuredOutputsParams"),
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(min_tokens=-1), "min_tokens must be >= 0, got -1"),
        (dict(min_tokens=20), "min_tokens must be <= max_tokens (16), got 20"),
        (dict(logprobs=-1), "logprobs must be"),
    ],
)
def test_invalid_values_raise(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(top_k=-1),
        dict(top_k=1),
        dict(top_p=1e-3),
        dict(min_p=1.0),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(seed=-5),
        dict(min_tokens=16),
        dict(max_tokens=1),
        dict(logprobs=0),
    ],
)
def test_limits_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(stop=123), "stop"),
        (dict(stop=[1]), "stop"),
        (dict(stop_token_ids=7), "stop_token_ids"),
        (dict(temperature="hot"), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p="1"), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(min_p=None), "min_p"),
        (dict(presence_penalty=True), "presence_penalty"),
        (dict(frequency_penalty=float("-inf")), "frequency_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(n="2"), "n"),
        (dict(top_k=1.5), "top_k"),
        (dict(seed=1.0), "seed"),
        (dict(max_tokens="16"), "max_tokens"),
        (dict(min_tokens=None), "min_tokens"),
        (dict(logprobs=1.0), "logprobs"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(skip_special_tokens=1), "skip_special_tokens"),
        (dict(spaces_between_special_tokens=None), "spaces_between_special_tokens"),
        (dict(include_stop_str_in_output="no"), "include_stop_str_in_output"),
    ],
)
def test_wrong_types_and_non_finite_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:  # a type error is both a TypeError and a ValueError
        SamplingParams(**kwargs)
    assert str(e.value).startswith(f"{field} must"), str(e.value)
    if field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                 "stop_token_ids") and not isinstance(next(iter(kwargs.values())), float):
        assert isinstance(e.value, TypeError)  # a wrong type is also a TypeError

"""Structured outputs (SamplingParams.structured_outputs, xgrammar): on SmolLM2, greedy and sampled, the outputs
obey their constraint (a choice, a regex, a JSON schema, any JSON) and end when it is complete; unconstrained
requests in the same batch are unchanged; bad constraints are ValueErrors naming the field and leave nothing."""

import json
import re

import pytest

pytest.importorskip("xgrammar")

from ostinato import SamplingParams  # noqa: E402
from ostinato.sampling_params import StructuredOutputsParams as S  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0},
                   "city": {"enum": ["Paris", "Rome", "Oslo"]}, "pets": {"type": "array", "items": {"type": "string",
                   "maxLength": 10}, "maxItems": 3}},
    "required": ["name", "age", "city", "pets"],
}


def chat(llm, messages, params):
    outs = llm.chat(messages, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def check_schema(obj: dict) -> None:
    assert set(obj) == {"name", "age", "city", "pets"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 16
    assert isinstance(obj["age"], int) and obj["age"] >= 0 and obj["city"] in ("Paris", "Rome", "Oslo")
    assert isinstance(obj["pets"], list) and len(obj["pets"]) <= 3


def test_constraints_hold_greedy_and_sampled(llm):
    ask = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    convs = [ask("Is Paris in France? Answer yes or no."), ask("Give me a phone number."),
             ask("Describe a person with pets as JSON."), ask("Describe your favourite city."),
             ask("Pick a fruit."), ask("Describe a person with pets as JSON."),
             ask("Give me a JSON object about a dog."), ask("Describe a person with pets as JSON.")]
    params = [
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=S(choice=["yes", "no"])),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=S(regex=r"\(0[1-9]\) [0-9]{3}-[0-9]{4}")),
        SamplingParams(temperature=0, max_tokens=120, structured_outputs=S(json=SCHEMA)),
        SamplingParams(temperature=0, max_tokens=24),  # unconstrained, beside the others
        SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=16,
                       structured_outputs=S(choice=["apple", "banana split", "cherry"])),
        SamplingParams(temperature=0.8, seed=2, max_tokens=120, structured_outputs=S(json=json.dumps(SCHEMA))),
        SamplingParams(temperature=0, max_tokens=48, structured_outputs=S(json_object=True)),
        SamplingParams(temperature=0, max_tokens=120, structured_outputs=S(json=SCHEMA, disable_any_whitespace=True)),
    ]
    outs = llm.chat(convs, params, use_tqdm=False)
    first = [o.outputs[0] for o in outs]
    assert first[0].text in ("yes", "no") and first[0].finish_reason == "stop"
    assert re.fullmatch(r"\(0[1-9]\) [0-9]{3}-[0-9]{4}", first[1].text) and first[1].finish_reason == "stop"
    for o in (first[2], first[5]):
        assert o.finish_reason == "stop", o.text
        check_schema(json.loads(o.text))
    alone = chat(llm, [convs[3]], SamplingParams(temperature=0, max_tokens=24))[0]
    assert first[3].token_ids == alone.token_ids
    assert all(c.text in ("apple", "banana split", "cherry") and c.finish_reason == "stop" for c in outs[4].outputs)
    obj = first[6]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # out of tokens: what there is must still be the start of a JSON object
        assert obj.finish_reason == "length" and obj.text.lstrip().startswith("{")
    tight = first[7]  # no whitespace but the one space after each separator (xgrammar's ", " and ": ")
    assert tight.finish_reason == "stop", tight.text
    check_schema(json.loads(tight.text))
    assert tight.text == json.dumps(json.loads(tight.text), ensure_ascii=False)


@pytest.mark.parametrize("spec,fragment", [
    (dict(regex="("), "structured_outputs: the regex constraint does not compile"),
    (dict(json={"type": "nonsense"}), "structured_outputs: the json constraint does not compile"),
    (dict(grammar="root ::= "), "structured_outputs: the grammar constraint does not compile"),
])
def test_bad_constraints_are_value_errors_and_leave_nothing(llm, spec, fragment):
    free = llm.engine.runner.allocator.available_pages()
    with pytest.raises(ValueError, match=re.escape(fragment)):
        llm.generate("hi", SamplingParams(max_tokens=4, structured_outputs=S(**spec)), use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.runner.allocator.available_pages() == free


@pytest.mark.parametrize("spec,fragment", [
    (dict(), "exactly one of"), (dict(regex="a", choice=["b"]), "exactly one of"),
    (dict(choice=[]), "structured_outputs.choice"), (dict(json=5), "structured_outputs.json"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(json_object=True, disable_any_whitespace="yes"), "structured_outputs.disable_any_whitespace"),
])
def test_bad_specs(spec, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        S(**spec)

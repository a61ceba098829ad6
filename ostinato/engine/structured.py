"""Structured outputs: a request's constraint (SamplingParams.structured_outputs) compiled by xgrammar into a
grammar over the model's vocabulary, and matched token by token.

Each step the runner asks every constrained request's matcher for the tokens it allows next (a bitmask the
sampler applies to the logits: runner/grammar_mask.py); the engine feeds the sampled token back
(`accept`). A step with such a request
is read back before the next one is scheduled, since the next mask depends on its token.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ostinato.sampling_params import StructuredOutputsParams

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarCompiler:
    """Compiles constraints for one model; xgrammar's compiler caches what it compiled."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None = None) -> None:
        """`stop_token_ids`: the tokens that end generation (the engine's EOS ids); a complete constraint lets
        any of them through (default: what xgrammar reads off the tokenizer)."""
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info)

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh xgrammar GrammarMatcher for `spec`; ValueError naming the field if it does not compile."""
        field, compile_ = self._compile_fn(spec)
        try:
            return self._xgr.GrammarMatcher(compile_())
        except Exception as e:  # xgrammar raises RuntimeError / ValueError for bad schemas, regexes, grammars
            why = _XGR_PREFIX.sub("", str(e)).strip()  # its "[time] source.cc:line: " prefix says nothing to a user
            raise ValueError(f"structured_outputs: the {field} constraint does not compile: {why}") from None

    def _compile_fn(self, spec: StructuredOutputsParams):
        c, ws = self._compiler, not spec.disable_any_whitespace
        if spec.json is not None:
            schema = json.dumps(spec.json) if isinstance(spec.json, dict) else spec.json
            return "json", lambda: c.compile_json_schema(schema, any_whitespace=ws)
        if spec.json_object:  # OpenAI's json_object: an object (the builtin JSON grammar allows any value)
            return "json_object", lambda: c.compile_json_schema('{"type": "object"}', any_whitespace=ws)
        if spec.regex is not None:
            return "regex", lambda: c.compile_regex(spec.regex)
        if spec.choice is not None:
            return "choice", lambda: c.compile_grammar(choice_grammar(spec.choice))
        return "grammar", lambda: c.compile_grammar(spec.grammar)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def accept(matcher: Any, token: int) -> str | None:
    """Feed a sampled token to the request's matcher: "stop" once the constraint is complete, "abort" if the
    token breaks it (the mask should have prevented it), else None."""
    if not matcher.accept_token(token):
        return "abort"
    return "stop" if matcher.is_terminated() else None

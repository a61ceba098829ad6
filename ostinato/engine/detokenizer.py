"""Incremental detokenization of one request's output, with stop strings.

Text is decoded over a short sliding window of tokens: `_prefix` marks where the window starts and
`_read` the tokens whose text is already in `output_text`. The new text is the window's decode minus
the decode of its already-read part, so tokenizers that render a token differently at the start of a
string stay consistent, and a multi-byte character split across tokens is only emitted once complete
(while the window's text ends in U+FFFD). Decoding starts at the first generated token, so the text
equals `tokenizer.decode(generated_ids, skip_special_tokens=...)`.
"""

from __future__ import annotations

from typing import Any

from ostinato.sampling_params import SamplingParams


def fast_decode(tokenizer: Any):
    """`tokenizer.decode` itself, or, for a fast tokenizer that cleans nothing up, its Rust tokenizer's decode
    (the same text, without transformers' per-call argument handling: about half the cost of a short decode)."""
    raw = getattr(tokenizer, "_tokenizer", None)
    if raw is None or not callable(getattr(raw, "decode", None)) or getattr(tokenizer, "clean_up_tokenization_spaces",
                                                                            True):
        return tokenizer.decode
    return lambda ids, skip_special_tokens=False: raw.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """`incremental=False` (a caller that reads the text only once the request ends, as the offline `LLM` does): a
    request without stop strings is decoded once, in `flush()`, and its pushes return no text; the same final
    text, without a decode per step on the host thread that launches the GPU's steps."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams,
                 decode: Any = None, incremental: bool = True) -> None:
        self.tokenizer = tokenizer
        self._decode_ids = decode or fast_decode(tokenizer)
        self.params = params
        self.stop: list[str] = list(params.stop or [])
        self.token_ids: list[int] = []
        self.output_text = ""  # stop string cut off (kept with include_stop_str_in_output)
        self.stop_reason: str | None = None  # the stop string that ended the text
        self._prefix = 0
        self._read = 0
        self._sent = 0  # length of output_text already returned as deltas
        # a tail that may still become a stop string is held back from deltas (not from output_text)
        hold = not params.include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1 if hold else 0
        self._deferred = not incremental and not self.stop

    def push(self, new_token_ids: list[int]) -> tuple[str, str | None]:
        """Add sampled tokens; returns (text delta, the stop string if one just matched, else None).

        The deltas of all pushes plus `flush()` concatenate to `output_text`. After a stop string the
        request is finished: don't push more.
        """
        assert self.stop_reason is None, "push after a stop string ended the text"
        self.token_ids.extend(new_token_ids)
        if self._deferred:
            return "", None
        old_len = len(self.output_text)
        self._decode(final=False)
        return self._finish_step(old_len, final=False)

    def flush(self) -> tuple[str, str | None]:
        """Call once when the request ends without a stop string (EOS, stop token, length, abort).

        Releases the held-back tail, and an incomplete trailing character as U+FFFD (as a full decode
        renders it); a stop string that this completes is still applied and returned.
        """
        if self.stop_reason is not None:
            return "", None
        old_len = len(self.output_text)
        self._decode(final=True)
        return self._finish_step(old_len, final=True)

    def _decode(self, final: bool) -> None:
        ids = self.token_ids
        skip = self.params.skip_special_tokens
        prefix_text = self._decode_ids(ids[self._prefix : self._read], skip_special_tokens=skip)
        new_text = self._decode_ids(ids[self._prefix :], skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return  # nothing new yet (skipped special token) or a character still incomplete
        self.output_text += new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(ids)

    def _finish_step(self, old_len: int, final: bool) -> tuple[str, str | None]:
        stop = self._find_stop(old_len)
        end = len(self.output_text)
        if stop is None and not final:
            end -= self._pending_stop_prefix()
        delta = self.output_text[self._sent : end]
        self._sent = end
        return delta, stop

    def _find_stop(self, old_len: int) -> str | None:
        """Earliest-ending stop string that ends in the new text (ties: the longer one); cuts the text.

        Earliest end, not earliest start, makes the result independent of how tokens were chunked.
        Like vLLM, stop strings only count once more than min_tokens tokens were generated.
        """
        if not self.stop or len(self.token_ids) <= self.params.min_tokens:
            return None
        text, best, best_at = self.output_text, None, 0
        for s in self.stop:
            i = text.find(s, max(0, old_len - len(s) + 1))
            if i >= 0 and (best is None or (i + len(s), i) < (best_at + len(best), best_at)):
                best, best_at = s, i
        if best is not None:
            self.stop_reason = best
            cut = best_at + len(best) if self.params.include_stop_str_in_output else best_at
            self.output_text = text[:cut]
        return best

    def _pending_stop_prefix(self) -> int:
        """Length of the longest tail of output_text that is a proper prefix of some stop string."""
        text = self.output_text
        for k in range(min(self._hold, len(text)), 0, -1):
            tail = text[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stop):
                return k
        return 0

"""Penalty state on the device: each request slot's output-token counts and, for repetition penalties, the tokens of
its prompt. Every sampling step adds the tokens it draws to the counts on the device, so a step with penalties needs
no token back on the host and overlap scheduling keeps running (SGLang's penalizers keep their counts the same way).

A slot's row is valid for the request that holds the slot from the first extend step in which the request samples
there: that step sets the row from the host (`resets_row`, `reset_rows`: the counts of its outputs so far, which a
retracted request brings back with it; its prompt's tokens). Rows are read only by steps in which their request
samples, so earlier chunks of a prefill leave them alone, and rows of requests without penalties go stale.
"""

import torch

from ostinato.runner.sampler import _put


def resets_row(req, samples: bool) -> bool:
    """Whether an extend step sets this request's row from the host: a penalized request that samples in the step
    with every output known (a decoding row of a mixed step with a token in flight keeps the row its earlier steps
    counted into). The tensor-parallel plan sends the host's lists to the workers by the same test."""
    return samples and req.num_pending == 0 and req.params.has_penalties


class PenaltyState:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        # one row per request slot and the sink row that rows sampling nothing store to (NextTokenBuffer.sink)
        self.num_rows = num_slots + 1
        self.vocab_size = vocab_size
        self.device = device
        # made at the first request with a penalty / a repetition penalty: [slots + 1, V] each (int32 counts: ~155 MB
        # at 256 slots and a 152k vocabulary; bool prompt marks: a quarter of that)
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None

    @staticmethod
    def bytes_for(num_slots: int, vocab_size: int) -> int:
        """The tables' size once made: int32 counts and bool prompt marks, [slots + 1, V] each. The KV pool is sized
        with this set aside (ModelRunner._tokens_from_memory), so the first penalized request cannot run the GPU
        out of memory mid-serving."""
        return (num_slots + 1) * vocab_size * (torch.int32.itemsize + torch.bool.itemsize)

    def warm_up(self, logits_row_strides: list[int]) -> None:
        """On CUDA, before serving: compile the penalize kernel's variants and launch once the ops that the first
        penalized request would otherwise launch first mid-serving (their first launch loads them: tens of ms, as
        `KVManager.warm_up` found for the prefix cache's). Changes no state."""
        from ostinato.layers.triton_ops.penalize import warm_up

        warm_up(self.vocab_size, logits_row_strides, self.device)
        scratch = torch.zeros(2, 4, dtype=torch.int32, device=self.device)
        rows = torch.zeros(1, dtype=torch.int64, device=self.device)
        scratch[rows] = 0
        scratch.view(-1).index_add_(0, rows, torch.ones_like(rows, dtype=torch.int32))
        torch.where(torch.zeros((), dtype=torch.bool, device=self.device), rows, rows)  # the sampler graph's count
        marks = torch.zeros(2, 4, dtype=torch.bool, device=self.device)
        marks[rows] = False
        marks[rows, rows] = True

    def reset_rows(self, reqs: list) -> None:
        """Set the rows of these penalized requests (at their `req_pool_idx`) from the host: the counts of their
        outputs so far (every one known: no step of theirs is in flight) and, with a repetition penalty, their
        prompt's tokens."""
        repeat = [r for r in reqs if r.params.repetition_penalty != 1.0]
        self._make(bool(repeat))
        slots = _put([r.req_pool_idx for r in reqs], torch.int64, self.device)
        self.counts[slots] = 0
        flat = [r.req_pool_idx * self.vocab_size + t for r in reqs for t in r.output_token_ids]
        if flat:
            self._add(_put(flat, torch.int64, self.device))
        if repeat:
            marked = _put([r.req_pool_idx for r in repeat], torch.int64, self.device)
            self.in_prompt[marked] = False
            rows = [r.req_pool_idx for r in repeat for _ in r.prompt_token_ids]
            tokens = [t for r in repeat for t in r.prompt_token_ids]
            self.in_prompt[_put(rows, torch.int64, self.device), _put(tokens, torch.int64, self.device)] = True

    def count_(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Add a step's drawn tokens to their slots' counts (on the device, in stream order: the next step's
        `rows` sees them). `slots`: int64 [B], the sink row for rows whose token is dropped."""
        self._add(slots * self.vocab_size + token_ids)

    def _add(self, flat: torch.Tensor) -> None:
        """counts.view(-1)[flat[i]] += 1 for each i, in one atomic-add kernel (index_put_ with accumulate sorts its
        indices first: several launches, 0.2-0.4 ms a step at bs 32); int32 sums are exact in any order."""
        self.counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))

    def rows(self, slots: torch.Tensor, repetition: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """With the slots bound (functools.partial), `SamplingTensors.from_params`' penalty_rows for a batch of these
        request slots: the counts, the prompt marks (None unless some row has a repetition penalty) and the slots
        (the penalize kernel reads the rows in place). A step may hold a penalized request before any has sampled
        (an earlier chunk of its prompt): the tables are made here too, and such a row's draw is dropped."""
        self._make(repetition)
        return self.counts, self.in_prompt if repetition else None, slots

    def _make(self, repetition: bool) -> None:
        """The tables, made at first need (a repetition penalty's marks only for one); as normal tensors even when
        the first need comes under inference mode (sampling), since the host's resets write them outside it."""
        with torch.inference_mode(False):
            if self.counts is None:
                self.counts = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.int32, device=self.device)
            if repetition and self.in_prompt is None:
                self.in_prompt = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.bool, device=self.device)

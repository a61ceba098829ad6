"""Front-end side of generation: detokenize incrementally, apply stop strings, build RequestOutputs.

Stop strings are found here, after detokenization; the request is then aborted in the core and
reported with finish_reason "stop".
"""

from dataclasses import dataclass

from ostinato.engine.detokenizer import IncrementalDetokenizer
from ostinato.engine.engine_core import EngineCoreOutput
from ostinato.outputs import CompletionOutput
from ostinato.sampling_params import SamplingParams


@dataclass
class RequestState:
    rid: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return self.detok.output_text if self.detok is not None else ""

    def completion(self, index: int = 0) -> CompletionOutput:
        return CompletionOutput(index, self.text, list(self.token_ids), self.finish_reason, self.stop_reason)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, rid: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) if self.tokenizer else None
        self.states[rid] = RequestState(rid, prompt_token_ids, params, detok, [])

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestState], list[str]]:
        """Updated request states, and the ids of requests a stop string ended (to abort in the core)."""
        updated, to_abort = [], []
        for out in outputs:
            state = self.states.get(out.rid)
            if state is None:
                continue
            state.token_ids.extend(out.new_token_ids)
            stop_str = None
            if state.detok is not None and out.new_token_ids:
                _, stop_str = state.detok.push(out.new_token_ids)
            if stop_str is not None:
                state.finish_reason, state.stop_reason = "stop", stop_str
                if out.finish_reason is None:
                    to_abort.append(out.rid)
            elif out.finish_reason is not None:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            if state.finish_reason is not None:
                del self.states[out.rid]
            updated.append(state)
        return updated, to_abort

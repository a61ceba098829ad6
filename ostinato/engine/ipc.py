"""Messages between the HTTP front end and the engine-core process: msgpack over ZMQ, plain data only.

front end -> engine: ("add", rid, prompt_token_ids, sampling_params_dict[, mm_inputs_dict]) | ("abort", [rid, ...])
    | ("shutdown",)
engine -> front end: {"type": "ready", ...limits and pool sizes} | {"type": "startup_error", "message"} once;
then ("outputs", [output_row, ...], stats_dict) per step | ("rejected", rid, message) | ("dead", message)
"""

import dataclasses
from typing import TYPE_CHECKING, Any

import msgpack

from ostinato.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine's modules load torch and the runner: the HTTP processes never import them
    from ostinato.engine.engine_core import EngineCoreOutput

ADD, ABORT, SHUTDOWN = "add", "abort", "shutdown"
READY, STARTUP_ERROR, OUTPUTS, REJECTED, DEAD = "ready", "startup_error", "outputs", "rejected", "dead"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**d)


def encode_outputs(outputs: "list[EngineCoreOutput]") -> list[list[Any]]:
    return [[o.rid, o.new_token_ids, o.finish_reason, o.stop_reason, o.logprobs, o.num_cached_tokens]
            for o in outputs]


def decode_outputs(rows: list[list[Any]]) -> "list[EngineCoreOutput]":
    from ostinato.engine.engine_core import EngineCoreOutput  # (the detokenizer process imports it at start)

    return [EngineCoreOutput(rid, ids, finish, stop, lps, cached) for rid, ids, finish, stop, lps, cached in rows]

"""Messages between the HTTP front end and the engine-core process: msgpack over ZMQ, plain data only.

front end -> engine: ("add", rid, prompt_token_ids, sampling_params_dict[, mm_inputs_dict]) | ("abort", [rid, ...])
    | ("shutdown",)
engine -> front end: {"type": "ready", ...limits and pool sizes} | {"type": "startup_error", "message"} once;
then ("outputs", [output_row, ...], stats_dict) per step | ("rejected", rid, message) | ("dead", message).
An output row: rid, new ids, finish reason, stop reason, logprobs, cached tokens, prompt logprobs; the
detokenizer process appends the text delta.
"""

import dataclasses
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from ostinato.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine's modules load torch and the runner: the HTTP processes never import them
    from ostinato.engine.engine_core import EngineCoreOutput

ADD, ABORT, SHUTDOWN = "add", "abort", "shutdown"
READY, STARTUP_ERROR, OUTPUTS, REJECTED, DEAD = "ready", "startup_error", "outputs", "rejected", "dead"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    # shallow (dataclasses.asdict deep-copies every list): the dict is packed at once and never kept
    d = {name: getattr(params, name) for name in _PARAM_FIELDS}
    if params.structured_outputs is not None:
        d["structured_outputs"] = dataclasses.asdict(params.structured_outputs)
    return d


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**d)


def encode_outputs(outputs: "list[EngineCoreOutput]") -> list[list[Any]]:
    return [[o.rid, o.new_token_ids, o.finish_reason, o.stop_reason, o.logprobs, o.num_cached_tokens,
             o.prompt_logprobs] for o in outputs]


def decode_outputs(rows: list[list[Any]]) -> "list[EngineCoreOutput]":
    from ostinato.engine.engine_core import EngineCoreOutput  # (the detokenizer process imports it at start)

    return [EngineCoreOutput(*row[:7]) for row in rows]


def engine_sockets(input_addr: str, output_addr: str, linger_ms: int) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """The engine side's sockets: PULL requests from `input_addr`, PUSH outputs to `output_addr` (no high-water
    marks: the front end bounds what it sends; `linger_ms` for outputs still queued at close)."""
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.RCVHWM, 0)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.setsockopt(zmq.LINGER, linger_ms)
    out.connect(output_addr)
    return ctx, inp, out

"""bench_decode.py's launch columns count the GPU activities inside each profiled phase's host range. The profiler
also lists a record_function range as GPU annotations of the same name, one a stream; the copy stream's spans only
the token copies, and when that one stood for the step window the first step's inputs and forward fell outside it
(`step_launches` read 95.5 for a 106-activity step on the H200)."""

import os
import sys

from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_decode import phase_spans  # noqa: E402


def event(name: str, start: float, end: float, device: DeviceType) -> FunctionEvent:
    return FunctionEvent(id=0, name=name, thread=0, start_us=start, end_us=end, device_type=device)


def test_a_phase_span_is_its_host_range_not_a_stream_annotation():
    # a step phase of two steps: the host range, then (as the profiler lists them) the compute stream's annotation
    # from the first input copy and the copy stream's from the first token copy
    events = [event("bench_decode/prepare", 0, 90, DeviceType.CPU),
              event("bench_decode/step", 100, 2_100, DeviceType.CPU),
              event("bench_decode/step", 130, 2_040, DeviceType.CUDA),
              event("bench_decode/step", 1_050, 2_060, DeviceType.CUDA),
              event("aten::copy_", 120, 125, DeviceType.CPU)]
    spans = phase_spans(events)
    assert set(spans) == {"prepare", "step"}
    assert (spans["step"].start, spans["step"].end) == (100, 2_100)
    first_forward = event("_wide_kernel", 140, 150, DeviceType.CUDA)  # the first step's, before its token copy
    assert spans["step"].start <= first_forward.time_range.start <= spans["step"].end

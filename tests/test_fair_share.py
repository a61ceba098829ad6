"""The front end's fair share: one request's choices enter the engine at most `max_in_engine` at a time
(AsyncEngineClient.generate against a fake engine: no model, no process)."""

import asyncio

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from ostinato.config import EngineArgs  # noqa: E402
from ostinato.engine import ipc  # noqa: E402
from ostinato.engine.async_client import AsyncEngineClient, EngineClientHooks, EngineInfo  # noqa: E402
from ostinato.engine.engine_core import EngineCoreOutput  # noqa: E402
from ostinato.sampling_params import SamplingParams  # noqa: E402


class FakeEngineClient(AsyncEngineClient):
    """Records what would go to the engine; `finish(rid)` plays the engine's output for a finished choice."""

    def _send(self, msg: tuple) -> None:
        self.sent.append(msg)
        if msg[0] == ipc.ADD:
            self.in_engine.add(msg[1])
            self.most_in_engine = max(self.most_in_engine, len(self.in_engine))
        elif msg[0] == ipc.ABORT:
            self.in_engine.difference_update(msg[1])

    def finish(self, rid: str, token: int) -> None:
        self.in_engine.discard(rid)
        self._on_outputs(ipc.encode_outputs([EngineCoreOutput(rid, [token], "length")]), {})


def make_client() -> FakeEngineClient:
    info = EngineInfo(pid=0, vocab_size=100, max_model_len=64, max_total_tokens=256, page_size=1,
                      max_running_requests=8, device="cpu", dtype="float32")
    client = FakeEngineClient(EngineArgs(skip_tokenizer_init=True), None, info, EngineClientHooks(), None, None, None,
                              None, "/nonexistent")
    client.sent, client.in_engine, client.most_in_engine = [], set(), 0
    return client


async def drive(client: FakeEngineClient, gen, stop_after: int | None = None) -> list:
    """Consume `gen` while finishing, in order, whatever the fake engine holds."""
    got: list = []

    async def engine() -> None:
        while True:
            await asyncio.sleep(0)
            for rid in sorted(client.in_engine):
                client.finish(rid, int(rid.rsplit("-", 1)[1]))

    task = asyncio.ensure_future(engine())
    try:
        async for d in gen:
            got.append(d)
            if stop_after is not None and len(got) >= stop_after:
                break
    finally:
        await gen.aclose()
        task.cancel()
    return got


@pytest.mark.parametrize("window", [1, 3, None])
def test_at_most_window_choices_in_the_engine(window):
    client = make_client()
    params = SamplingParams(n=5, max_tokens=1, seed=10)
    got = asyncio.run(drive(client, client.generate("r", [[1, 2], [3]], params, window)))
    assert sorted(d.index for d in got) == list(range(10))  # 2 prompts x n=5, every choice once
    assert all(d.token_ids == [d.index] and d.finish_reason == "length" for d in got)
    assert client.most_in_engine == (10 if window is None else window)
    adds = [m for m in client.sent if m[0] == ipc.ADD]
    assert [m[1] for m in adds] == [f"r-{i}" for i in range(10)]  # in index order
    assert [m[2] for m in adds] == [[1, 2]] * 5 + [[3]] * 5
    assert [m[3]["seed"] for m in adds] == [10, 11, 12, 13, 14] * 2 and all(m[3]["n"] == 1 for m in adds)
    assert not client._children and not client.in_engine


def test_leaving_early_aborts_only_what_was_sent():
    client = make_client()
    got = asyncio.run(drive(client, client.generate("r", [[1]], SamplingParams(n=6, max_tokens=1), 2), stop_after=1))
    assert len(got) == 1
    aborts = [m for m in client.sent if m[0] == ipc.ABORT]
    sent = {m[1] for m in client.sent if m[0] == ipc.ADD}
    assert len(sent) < 6  # the rest were never sent
    assert all(set(m[1]) <= sent for m in aborts)
    assert not client._children and not client.in_engine  # nothing left registered or running

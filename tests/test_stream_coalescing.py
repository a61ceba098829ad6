"""A slow stream gets what piled up as one delta per choice: same text, tokens and logprobs, in order."""

from ostinato.engine.async_client import ChoiceDelta, coalesce_deltas


def delta(index: int, tok: int, finish: str | None = None) -> ChoiceDelta:
    return ChoiceDelta(index, f"<{tok}>", [tok], [(-0.1 * tok, 1, [tok], [-0.1 * tok])], finish)


def test_runs_of_one_choice_merge_in_order():
    items = [delta(0, 1), delta(0, 2), delta(1, 7), delta(1, 8, "length"), delta(0, 3, "stop")]
    out = coalesce_deltas(items)
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in out] == [
        (0, "<1><2>", [1, 2], None), (1, "<7><8>", [7, 8], "length"), (0, "<3>", [3], "stop")]
    assert [lp[0] for lp in out[0].logprobs] == [-0.1, -0.2]
    # every token of the input is in the output exactly once, in the same per-choice order
    for i in (0, 1):
        assert sum((d.token_ids for d in out if d.index == i), []) == sum(
            (d.token_ids for d in items if d.index == i), [])


def test_finished_delta_and_errors_are_not_merged_over():
    err = RuntimeError("engine died")
    out = coalesce_deltas([delta(0, 1, "stop"), delta(0, 2), err, delta(0, 3), delta(0, 4)])
    assert out[0].token_ids == [1] and out[1].token_ids == [2] and out[2] is err and out[3].token_ids == [3, 4]


def test_the_first_deltas_prompt_logprobs_survive_a_merge():
    first = delta(0, 1)
    first.prompt_logprobs = [(-1.0, 2, [5], [-0.5])]
    out = coalesce_deltas([first, delta(0, 2), delta(1, 3)])
    assert out[0].token_ids == [1, 2] and out[0].prompt_logprobs == [(-1.0, 2, [5], [-0.5])]
    assert out[1].prompt_logprobs is None

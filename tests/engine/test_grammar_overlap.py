"""Grammar rows under overlap scheduling (forced on the CPU): a row's forward runs ahead of the
previous token's commit, its mask is filled in the background once the matchers have that token,
and its sampling is launched as soon as the device can wait for the fill (engine/core/results.py).

Oracle: the plain loop, same seeds (a row's token depends only on its logits, seed and position).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("xgrammar")

CODE = "[0-9]{3}-[a-z]{2}"
PROMPTS = [[5 + i, 9, 12 + 2 * i] for i in range(6)]
PARAMS = [{"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": i, **({"regex": CODE} if i % 2 else {})}
          for i in range(6)]


class _HostGate:
    """A StreamGate stand-in on the CPU: the device never waits (wait is False), so the host joins
    the fill as without one; what changes is the core's order, which follows `gate is not None`."""

    def wait(self, seq: int) -> bool:
        return False

    def open(self, seq: int) -> None:
        pass


def _answers_before_each_sampling(core) -> list[int]:
    """For each sampling launched while a step is answered (a lookahead's): how many of that
    step's requests had been answered."""
    results, runner, seen = core.results, core.runner, []
    count = {"answered": 0, "inside": False}
    answer, after_token, sample = results.answer, results._after_token, runner.sample

    def counted_answer(*args, **kwargs):
        count.update(answered=0, inside=True)
        try:
            return answer(*args, **kwargs)
        finally:
            count["inside"] = False

    def counted_after_token(*args, **kwargs):
        count["answered"] += 1
        return after_token(*args, **kwargs)

    def spied_sample(forward):
        if count["inside"]:
            seen.append(count["answered"])
        return sample(forward)

    results.answer, results._after_token, runner.sample = counted_answer, counted_after_token, spied_sample
    return seen


@pytest.mark.parametrize("gated", [False, True])
def test_grammar_rows_run_ahead_with_sampling_after_the_commit(engine_factory, gated):
    """Same outputs as the plain loop, and the lookahead and the prefetched masks really ran. With a
    gate the lookahead's sampling is launched before the step's answers (the device waits for the
    fill, the host answers meanwhile); without one (the host waits for the fill) after them."""
    plain = engine_factory(enable_deterministic_inference=True)
    overlapped = engine_factory(enable_deterministic_inference=True)
    core = overlapped.local_core
    core.overlap = True
    if gated:
        core.runner.grammar_masks.gate = _HostGate()
    want = plain.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    launched_after = _answers_before_each_sampling(core)
    got = overlapped.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert all(re.fullmatch(CODE, o["text"]) for o in got[1::2]), [o["text"] for o in got]
    assert core.stats.num_lookahead_steps > 5
    assert core.runner.grammar_masks.num_taken >= 4  # steps with a live grammar row, bar the first
    ahead = [n for n in launched_after if n]  # the lookahead steps' samplings launched after answers
    assert len(launched_after) > 5 and (not ahead if gated else len(ahead) > 5), launched_after
    overlapped.check_integrity()

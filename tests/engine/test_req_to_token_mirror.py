"""The runner's device copy of req_to_token follows the host table's rewrites.

A prefill's commit points its row at the radix tree's slots and frees its own duplicates (a
sample admitted from a cached prompt recomputes the prompt's last token in a slot of its own;
samples prefilled together compute their shared stretch twice). A device copy left at the freed
slots reads whatever reuses them. On the CPU the runner shares the host table, so the test gives
it a copy of its own, as on a GPU, and checks every live row after each pass.
"""

from __future__ import annotations

from tests.engine.conftest import random_prompts


def test_mirror_equals_host_table_after_commits(engine_factory):
    eng = engine_factory(disable_overlap_schedule=True)
    runner = eng.local_core.parts.runner
    host = runner.req_to_token_pool.req_to_token
    runner.req_to_token = host.clone()  # a mirror, as on a GPU
    seen = []
    forward = runner.forward

    def checked_forward(batch, inflight=None):
        out = forward(batch, inflight)
        for req, n in zip(batch.reqs, batch.seq_lens()):
            row = req.req_pool_idx
            seen.append(bool((runner.req_to_token[row, :n] == host[row, :n]).all()))
        return out

    runner.forward = checked_forward
    prompts = random_prompts(2, eng.local_core.parts.vocab_size, lengths=(30, 50), seed=7)
    eng.generate(input_ids=prompts[:1], sampling_params={"max_new_tokens": 2})  # cached first
    eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, "n": 4, "ignore_eos": True})
    assert len(seen) > 10 and all(seen[len(seen) // 2:])  # rewritten rows are up to date at decode
    rewrites = runner.req_to_token_pool.take_written()
    assert rewrites is None or rewrites.shape[0] == 3

"""SharedPrefixPlan / SharedPrefixFinder: which decode rows share a cached prefix, on the host."""

from __future__ import annotations

import torch

from engine.attention.shared_prefix import SharedPrefixFinder, shared_prefix_plan


def table_with_groups():
    """req_to_token rows 1..6: rows 1-3 share slots [0, 40) (then differ), rows 4-5 share
    [0, 10), row 6 stands alone."""
    table = torch.zeros((8, 64), dtype=torch.int64)
    slot = iter(range(1, 10_000))
    prompt = [next(slot) for _ in range(40)]
    for row in (1, 2, 3):
        table[row, :40] = torch.tensor(prompt)
        table[row, 40:] = torch.tensor([next(slot) for _ in range(24)])
    short = [next(slot) for _ in range(10)]
    for row in (4, 5):
        table[row, :10] = torch.tensor(short)
        table[row, 10:] = torch.tensor([next(slot) for _ in range(54)])
    table[6] = torch.tensor([next(slot) for _ in range(64)])
    return table


def test_groups_and_longest_common_prefix():
    table = table_with_groups()
    plan = shared_prefix_plan(table, [1, 4, 2, 6, 3, 5], [50, 60, 45, 50, 41, 60],
                              min_shared_len=4, min_saved_keys=1)
    groups = {tuple(plan.rows[a:a + n]): length for a, n, length in zip(plan.starts, plan.sizes, plan.lens)}
    assert groups == {(0, 2, 4): 40, (1, 5): 10}
    assert plan.prefix_lens == [40, 10, 40, 0, 40, 10]


def test_shared_length_stops_before_each_rows_decoded_token():
    table = table_with_groups()  # rows 1-3 share 40 slots; one row is at length 30
    plan = shared_prefix_plan(table, [1, 2, 3], [50, 30, 45], min_shared_len=4, min_saved_keys=1)
    assert plan.lens == [29]  # position 29 is the short row's token being decoded: its own


def test_thresholds_drop_short_or_small_sharing():
    table = table_with_groups()
    assert shared_prefix_plan(table, [4, 5], [60, 60], min_shared_len=16, min_saved_keys=1) is None
    assert shared_prefix_plan(table, [1, 2, 3], [50, 50, 50], min_shared_len=4, min_saved_keys=81) is None
    assert shared_prefix_plan(table, [1, 2, 3], [50, 50, 50], min_shared_len=4, min_saved_keys=80) is not None
    assert shared_prefix_plan(table, [1, 6], [50, 50], min_shared_len=4, min_saved_keys=1) is None
    assert shared_prefix_plan(table, [1], [50], min_shared_len=4, min_saved_keys=1) is None


def test_wide_groups_are_cut_into_near_equal_blocks():
    table = torch.zeros((20, 32), dtype=torch.int64)
    table[:, :20] = torch.arange(1, 21)
    for row in range(20):
        table[row, 20:] = torch.arange(100 + 12 * row, 112 + 12 * row)
    plan = shared_prefix_plan(table, list(range(1, 18)), [30] * 17, min_shared_len=4, min_saved_keys=1)
    blocks = plan.blocks(max_members=8)
    assert [b[1] for b in blocks] == [5, 6, 6]  # 17 rows: no block of one
    assert [b[0] for b in blocks] == [0, 5, 11] and all(b[3] == 20 for b in blocks)
    assert all(b[2] == plan.rows[b[0]] for b in blocks)


def test_packed_layout_and_graph_padding():
    table = table_with_groups()
    plan = shared_prefix_plan(table, [1, 2, 6], [50, 50, 50], min_shared_len=4, min_saved_keys=1)
    packed = plan.packed(max_members=8)
    assert packed.dtype == torch.int32 and packed.tolist() == [40, 40, 0, 0, 2, 0, 40, 0, 1, 0]
    padded = plan.packed(max_members=8, pad_to=4)
    lens, blocks, rows = padded[:4], padded[4:20].view(4, 4), padded[20:]
    assert lens.tolist() == [40, 40, 0, 0]
    assert blocks[:, 0].tolist() == [0, 2, 0, 40] and blocks[1, 1:].tolist() == [0, 0, 0]
    assert rows.tolist() == [0, 1, 0, 0]
    assert plan.packed(max_members=8, pad_to=4) is padded  # built once per plan


def test_finder_keeps_the_plan_while_the_batch_holds_the_same_requests():
    table = table_with_groups()
    finder = SharedPrefixFinder(min_shared_len=4, min_saved_keys=1)
    reqs = [object(), object()]
    first = finder.find(reqs, table, [1, 2], [50, 50], generation=3)
    assert first is not None and finder.find(list(reqs), table, [1, 2], [51, 51], generation=3) is first
    assert finder.find(reqs, table, [1, 2], [52, 52], generation=4) is not first  # rows changed hands
    table[2, :40] = torch.arange(500, 540)  # a new request in the row: a new batch, a new plan
    assert finder.find([reqs[0], object()], table, [1, 2], [50, 50]) is None


def test_prompts_behind_one_template_group_per_prompt():
    """Two prompts of 40 tokens behind a 6-token chat template, 3 samples each, and one more
    sample that shares only the template: each prompt's samples share 46 keys; the template alone
    is too short to be worth sharing."""
    table = torch.zeros((9, 64), dtype=torch.int64)
    slot = iter(range(1, 10_000))
    template = [next(slot) for _ in range(6)]
    prompts = [[next(slot) for _ in range(40)] for _ in range(3)]
    for row in range(1, 8):
        prompt = prompts[0] if row <= 3 else prompts[1] if row <= 6 else prompts[2]
        table[row, :46] = torch.tensor(template + prompt)
        table[row, 46:] = torch.tensor([next(slot) for _ in range(18)])
    plan = shared_prefix_plan(table, list(range(1, 8)), [60] * 7, min_shared_len=8, min_saved_keys=1)
    groups = {tuple(plan.rows[a:a + n]): length for a, n, length in zip(plan.starts, plan.sizes, plan.lens)}
    assert groups == {(0, 1, 2): 46, (3, 4, 5): 46}
    # with a template long enough to share, rows left alone past it share it with each other
    table[8] = table[7]
    table[8, 20:] = torch.arange(500, 544)
    plan = shared_prefix_plan(table, list(range(1, 9)), [60] * 8, min_shared_len=4, min_saved_keys=1)
    groups = {tuple(plan.rows[a:a + n]): length for a, n, length in zip(plan.starts, plan.sizes, plan.lens)}
    assert groups == {(0, 1, 2): 46, (3, 4, 5): 46, (6, 7): 20}

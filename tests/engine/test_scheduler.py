"""Scheduler on its own (no model): admission forecast, chunking, policy, retraction, abort."""

from __future__ import annotations

import time

import pytest

from engine.kv.allocator import TokenSlotAllocator
from engine.kv.pool import ReqToTokenPool
from engine.kv.radix_cache import RadixCache
from engine.scheduler.request import Req
from engine.forward_batch import ForwardMode
from engine.sampling_params import SamplingParams
from engine.scheduler.scheduler import Scheduler, SchedulerConfig
from engine.scheduler.policy import LPM_MAX_WAITING


def make_scheduler(pool=1000, max_running=64, chunk=None, policy="fcfs", max_prefill=16384):
    alloc = TokenSlotAllocator(pool)
    rows = ReqToTokenPool(max_running + 1, 512, "cpu")
    cache = RadixCache(alloc, rows)
    cfg = SchedulerConfig(max_running, chunk, max_prefill, policy)
    return Scheduler(cfg, cache, alloc, rows)


def make_req(rid, prompt, max_new=16, ignore_eos=False):
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)
    return Req(rid=rid, origin_input_ids=list(prompt), sampling_params=params, seed=0)


def run_step(s: Scheduler, token: int = 7):
    """Schedule and commit one step with a fake model that always emits `token`."""
    batch = s.schedule()
    if batch is None:
        return None
    s.commit(batch, [token] * batch.batch_size)
    for req in list(s.running):
        if len(req.output_ids) >= req.sampling_params.max_new_tokens:
            req.finished_reason = {"type": "length"}
            s.release(req)
    return batch


def test_new_requests_are_charged_input_plus_max_new_tokens():
    s = make_scheduler(pool=100)
    for i in range(5):
        s.add_request(make_req(f"r{i}", range(10 * i + 1, 10 * i + 21), max_new=20))
    batch = s.schedule()
    # each request needs 20 prompt + 20 new = 40 tokens; only 2 fit in 100
    assert batch.forward_mode is ForwardMode.EXTEND and batch.batch_size == 2


def test_running_requests_reserve_at_new_token_ratio_and_ignore_eos_at_one():
    s = make_scheduler(pool=200)
    s.add_request(make_req("a", range(1, 11), max_new=100))
    run_step(s)  # a is running, reserves 99 * 0.7 ~ 69 tokens
    s.add_request(make_req("b", range(20, 30), max_new=100))
    assert s.schedule().reqs[0].rid == "b"  # 10 + 100 <= 200 - 11 - 69

    s2 = make_scheduler(pool=200)
    s2.add_request(make_req("a", range(1, 11), max_new=100, ignore_eos=True))
    run_step(s2)  # ignore_eos: reserves the full 99
    s2.add_request(make_req("b", range(20, 30), max_new=100))
    batch = s2.schedule()
    assert batch.forward_mode is ForwardMode.DECODE  # b does not fit: 110 > 200 - 11 - 99


def test_new_token_ratio_decays_and_jumps_on_retraction():
    s = make_scheduler(pool=100, max_running=8)
    start = s.new_token_ratio
    for i in range(4):
        s.add_request(make_req(f"r{i}", range(10 * i + 1, 10 * i + 9), max_new=30))
    ratios = []
    while s.has_work() and s.num_retractions == 0:
        run_step(s)
        ratios.append(s.new_token_ratio)
    assert min(ratios) < start
    assert s.num_retractions > 0 and s.new_token_ratio > min(ratios)


def test_chunked_prefill_cuts_and_continues_first():
    s = make_scheduler(chunk=8)
    s.add_request(make_req("long", range(1, 21)))
    s.add_request(make_req("short", range(30, 34)))
    b1 = s.schedule()
    assert [r.rid for r in b1.reqs] == ["long"] and b1.extend_lens == [8]
    s.commit(b1, [0])
    b2 = s.schedule()
    assert b2.reqs[0].rid == "long" and b2.prefix_lens[0] == 8 and b2.extend_lens[0] == 8
    s.commit(b2, [0])
    b3 = s.schedule()
    assert [r.rid for r in b3.reqs] == ["long", "short"] and b3.extend_lens == [4, 4]
    s.commit(b3, [5, 6])
    assert s.chunked_req is None and len(s.running) == 2
    assert [r.output_ids for r in s.running] == [[5], [6]]
    s.check_integrity()


def test_lpm_prefers_cached_prefix_and_falls_back_to_fcfs():
    s = make_scheduler(policy="lpm", max_running=1)
    s.add_request(make_req("seed", range(1, 41), max_new=1))
    run_step(s)
    s.add_request(make_req("cold", range(100, 140), max_new=1))
    s.add_request(make_req("warm", list(range(1, 41)) + [99], max_new=1))
    assert s.schedule().reqs[0].rid == "warm"

    s2 = make_scheduler(policy="lpm", max_running=1)
    s2.add_request(make_req("seed", range(1, 41), max_new=1))
    run_step(s2)
    for i in range(LPM_MAX_WAITING):
        s2.add_request(make_req(f"cold{i}", [200 + i, 1, 2], max_new=1))
    s2.add_request(make_req("warm", list(range(1, 41)) + [99], max_new=1))
    assert s2.schedule().reqs[0].rid == "cold0"  # over the threshold: fcfs


def test_retraction_takes_least_progress_first_and_nothing_leaks():
    s = make_scheduler(pool=100, max_running=8)
    for i in range(4):
        s.add_request(make_req(f"r{i}", range(10 * i + 1, 10 * i + 9), max_new=30))
    while s.has_work():
        before = {r.rid: len(r.output_ids) for r in s.running}
        n_retracted = s.num_retractions
        run_step(s)
        if s.num_retractions > n_retracted:
            back = [r for r in s.waiting if r.num_retractions > 0]
            assert back and all(before[r.rid] <= min(before.values()) + 1 for r in back[:1])
        s.check_integrity()
    assert s.num_retractions > 0
    assert s.allocator.available_size() + s.tree_cache.total_size() == 100


def test_abort_waiting_and_running():
    s = make_scheduler()
    s.add_request(make_req("run", range(1, 9)))
    run_step(s)
    s.add_request(make_req("wait", range(20, 29)))
    waiting = s.abort_request("wait")
    assert waiting.finished_reason["type"] == "abort"
    s.abort_request("run", "stop now")
    s.schedule()
    done = s.pop_finished()
    assert [r.rid for r in done] == ["run"] and done[0].finished_reason["message"] == "stop now"
    s.check_integrity()
    assert s.flush_cache()


@pytest.mark.parametrize("n_waiting", [1000, 20000])
def test_step_cost_does_not_grow_with_waiting_queue(n_waiting):
    s = make_scheduler(pool=10_000, max_running=4)
    for i in range(n_waiting):
        s.add_request(make_req(f"r{i}", [1 + i % 50, 2, 3], max_new=4))
    start = time.perf_counter()
    for _ in range(20):
        run_step(s)
    per_step = (time.perf_counter() - start) / 20
    assert per_step < 0.02, f"{per_step * 1e3:.2f} ms per step with {n_waiting} waiting"


def test_siblings_sharing_an_uncached_prefix_wait_one_round():
    s = make_scheduler()
    prompt = list(range(1, 65))
    for i in range(4):
        s.add_request(make_req(f"g{i}", prompt, max_new=4))
    s.add_request(make_req("other", range(100, 140), max_new=4))
    first = s.schedule()
    assert [r.rid for r in first.reqs] == ["g0", "other"]
    s.commit(first, [1, 1])
    second = s.schedule()
    assert [r.rid for r in second.reqs] == ["g1", "g2", "g3"]
    assert second.prefix_lens == [63, 63, 63]


def test_decode_steps_never_copy_a_whole_sequence(monkeypatch):
    """A decode step reads each request's last token: building prompt + outputs per request per
    step (as it once did, twice) costs O(sequence) each, more than the step at 16k tokens."""
    s = make_scheduler(pool=10_000, max_running=4)
    for i in range(3):
        s.add_request(make_req(f"r{i}", [i + 1] * 300, max_new=50))
    run_step(s)  # the prefill
    copies = []
    real = Req.all_ids
    monkeypatch.setattr(Req, "all_ids", property(lambda req: copies.append(req.rid) or real.fget(req)))
    for _ in range(10):
        batch = s.schedule()
        assert batch.forward_mode is ForwardMode.DECODE
        assert batch.input_ids() == [r.output_ids[-1] for r in batch.reqs]
        s.commit(batch, [9] * batch.batch_size)
    assert copies == []


def test_fill_ids_read_lazily_slice_like_the_list():
    req = make_req("a", [1, 2, 3, 4])
    req.output_ids = [5, 6]
    req.fill_all()
    assert req.fill_ids == [1, 2, 3, 4, 5, 6] and req.fill_len == 6
    for start, end in [(0, 6), (2, 5), (4, 6), (5, 6), (3, 4), (0, 0), (6, 6)]:
        assert req.fill_slice(start, end) == [1, 2, 3, 4, 5, 6][start:end]
    req.fill_ids = [1, 2, 3]
    assert req.fill_len == 3 and req.fill_slice(1, 3) == [2, 3] and req.max_prefix_len() == 2

"""update_weights_from_distributed over gloo: a trainer process broadcasts, CPU engines load.

The trainer is a real second process (rank 0, it hosts the rendezvous store), as in RL: tandem's
own WeightGroup, or slime's group-formation sequence (tests/weight_sync/slime_trainer.py), per
tensor or per flattened bucket, to one engine or two replicas of one group; a trainer that dies or
never sends fails the update within the group's timeout and the engine goes on serving.
Oracle: an engine started on the broadcast checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.engine.conftest import random_prompts
from engine.models.parallel_state import free_port

REPO = Path(__file__).resolve().parents[2]  # the repo root: the trainer imports engine, weight_sync
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
TRAINER = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import load_file
    from engine.models.loader import safetensors_files
    from weight_sync.nccl import WeightGroup
    port, model_dir = int(sys.argv[1]), sys.argv[2]
    group = WeightGroup("127.0.0.1", port, 0, 2, "wg", backend="gloo", timeout_s=60)
    named = [kv for path in safetensors_files(model_dir) for kv in load_file(path).items()]
    for _, tensor in named:
        group.broadcast(tensor.contiguous(), src=0)
    group.broadcast(torch.ones(3), src=0)  # the second update: one tensor, an unknown name
    print("trainer done", flush=True)
    import os
    os._exit(0)  # skip the gloo group's teardown at exit: the test is over, its peer may be gone
""")


def test_broadcast_update_equals_an_engine_on_the_new_weights(engine_factory, other_model_dir, other_engine):
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    eng = engine_factory()
    prompts = random_prompts(2, eng.local_core.parts.vocab_size, lengths=(5, 40), seed=7)
    before = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
    named = [kv for path in safetensors_files(other_model_dir) for kv in load_file(path).items()]
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), other_model_dir], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ok, message = eng.init_weights_update_group("127.0.0.1", port, 1, 2, "wg", backend="gloo")
        assert ok, message
        assert eng.init_weights_update_group("127.0.0.1", port, 1, 2, "wg", backend="gloo")[0] is False
        ok, message = eng.update_weights_from_distributed(
            [n for n, _ in named], [str(t.dtype) for _, t in named], [list(t.shape) for _, t in named],
            "wg", weight_version="dist-1")
        assert ok, message
        after = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
        assert after == [o["output_ids"] for o in other_engine.generate(input_ids=prompts, sampling_params=GREEDY)]
        assert after != before and eng.get_weight_version() == "dist-1"
        ok, message = eng.update_weights_from_distributed(  # the bad dtype is second: still nothing received
            ["model.norm.weight", "model.norm.weight"], ["float32", "float23"], [[64], [64]], "wg")
        assert not ok and "unknown dtype 'float23'" in message and "nothing was received" in message
        ok, message = eng.update_weights_from_distributed(["model.nope.weight"], ["float32"], [[3]], "wg")
        assert not ok and "unknown weight 'model.nope.weight'" in message, message
        assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)] == after
        out, _ = trainer.communicate(timeout=60)
        assert trainer.returncode == 0 and "trainer done" in out, (trainer.returncode, out)
    finally:
        trainer.kill()
    ok, message = eng.update_weights_from_distributed(["x"], ["float32"], [[1]], "other")
    assert not ok and "init_weights_update_group first" in message
    assert eng.destroy_weights_update_group("wg")[0] and not eng.destroy_weights_update_group("wg")[0]
    with pytest.raises(ValueError, match="load_format"):
        eng.update_weights_from_distributed([], [], [], "wg", load_format="direct")
    eng.check_integrity()


def test_bad_group_arguments_are_named(engine_factory):
    eng = engine_factory()
    ok, message = eng.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "g", backend="mpi")
    assert not ok and "backend must be one of nccl, gloo" in message
    ok, message = eng.init_weights_update_group("127.0.0.1", free_port(), 2, 2, "g", backend="gloo")
    assert not ok and "rank 2 is outside a group of world_size 2" in message


SLIME_TRAINER = REPO / "tests" / "weight_sync" / "slime_trainer.py"


def _slime_trainer(port: int, world_size: int, name: str, model_dir: str, send: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, str(SLIME_TRAINER), str(port), str(world_size), name, model_dir, send],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _join(engines: list, port: int, name: str, timeout_s: float = 60.0) -> list[list]:
    """Every engine joins at once (rank 1, 2, ...): the trainer's store waits for all of them.
    -> the trainer's bucket layout (names per bucket), read once the group formed."""
    world_size = len(engines) + 1
    with ThreadPoolExecutor(len(engines)) as pool:
        answers = list(pool.map(lambda i: engines[i].init_weights_update_group(
            "127.0.0.1", port, i + 1, world_size, name, backend="gloo", timeout_s=timeout_s), range(len(engines))))
    assert all(ok for ok, _ in answers), answers
    return answers


def _listening(trainer: subprocess.Popen) -> None:
    """Wait out the trainer's start-up (imports, checkpoint read): a join with a timeout of a few
    seconds must measure the group, not how long a loaded CI machine takes to start Python."""
    for line in trainer.stdout:
        if line.strip() == "listening":
            return
    raise AssertionError(f"the trainer ended before hosting the rendezvous (rc {trainer.wait()})")


def _layout(trainer: subprocess.Popen) -> list[list[str]]:
    for line in trainer.stdout:
        if line.startswith("joined "):
            return json.loads(line.removeprefix("joined "))["buckets"]
    raise AssertionError(f"the trainer ended before joining (rc {trainer.wait()})")


def _checkpoint(model_dir: str) -> dict:
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    return {k: v for path in safetensors_files(model_dir) for k, v in load_file(path).items()}


def _greedy(eng, prompts) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]


def test_a_group_formed_as_slime_forms_it_carries_per_tensor_broadcasts(engine_factory, other_model_dir,
                                                                        other_engine):
    """slime's trainer: torch's tcp:// rendezvous store waiting for every worker, its group-name
    prefix and process-group helper; one broadcast per tensor, the request shape slime sends."""
    eng = engine_factory()
    prompts = random_prompts(2, eng.local_core.parts.vocab_size, lengths=(5, 40), seed=17)
    port = free_port()
    trainer = _slime_trainer(port, 2, "slime-pp_0", other_model_dir, "tensors")
    try:
        _join([eng], port, "slime-pp_0")
        names = [n for bucket in _layout(trainer) for n in bucket]
        ckpt = _checkpoint(other_model_dir)
        ok, message = eng.update_weights_from_distributed(
            names=names, dtypes=[ckpt[n].dtype for n in names], shapes=[ckpt[n].shape for n in names],
            group_name="slime-pp_0", weight_version="1")  # torch dtypes and sizes, as slime passes them over Ray
        assert ok, message
        assert trainer.wait(60) == 0
    finally:
        trainer.kill()
    assert _greedy(eng, prompts) == _greedy(other_engine, prompts) and eng.get_weight_version() == "1"
    assert eng.destroy_weights_update_group("slime-pp_0")[0]


def test_one_trainer_broadcasts_flattened_buckets_to_two_replicas(engine_factory, other_model_dir, other_engine):
    """Two engines of one group (rank_offset 1 and 2), one broadcast per bucket reaching both."""
    engines = [engine_factory(), engine_factory()]
    prompts = random_prompts(3, engines[0].local_core.parts.vocab_size, lengths=(5, 40), seed=18)
    port = free_port()
    trainer = _slime_trainer(port, 3, "replicas", other_model_dir, "buckets")
    ckpt = _checkpoint(other_model_dir)
    try:
        _join(engines, port, "replicas")
        buckets = _layout(trainer)
        assert len(buckets) > 3  # several buckets, each one broadcast
        for i, names in enumerate(buckets):
            last = i == len(buckets) - 1
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda e: e.update_weights_from_distributed(
                    names, [str(ckpt[n].dtype) for n in names], [list(ckpt[n].shape) for n in names], "replicas",
                    flush_cache=last, weight_version="r-1" if last else None, load_format="flattened_bucket"),
                    engines))
            assert all(ok for ok, _ in answers), answers
        assert trainer.wait(60) == 0
    finally:
        trainer.kill()
    expected = _greedy(other_engine, prompts)
    for eng in engines:
        assert _greedy(eng, prompts) == expected and eng.get_weight_version() == "r-1"
        assert eng.destroy_weights_update_group("replicas")[0]


def test_a_dead_or_silent_trainer_fails_the_update_in_time_and_the_group_forms_again(
        engine_factory, other_model_dir, other_engine):
    eng = engine_factory()
    prompts = random_prompts(2, eng.local_core.parts.vocab_size, lengths=(5, 40), seed=19)
    before = _greedy(eng, prompts)
    ckpt = _checkpoint(other_model_dir)
    names = list(ckpt)
    request = (names, [str(ckpt[n].dtype) for n in names], [list(ckpt[n].shape) for n in names], "wg")

    port = free_port()  # killed after its first tensor, while the engine waits for the second
    trainer = _slime_trainer(port, 2, "wg", other_model_dir, "one-then-hang")
    try:
        _join([eng], port, "wg", timeout_s=20)
        _layout(trainer)
        reply: list = []
        receiver = threading.Thread(target=lambda: reply.append(eng.update_weights_from_distributed(*request)))
        start = time.monotonic()
        receiver.start()
        assert trainer.stdout.readline().strip() == "sent one"
        trainer.kill()
        receiver.join(30)
        assert time.monotonic() - start < 20 and reply, "the update outlived the group's timeout"
    finally:
        trainer.kill()
    ok, message = reply[0]
    assert not ok and "broadcast in group 'wg' failed" in message and "destroy_weights_update_group" in message
    assert _greedy(eng, prompts) == before  # nothing loaded, still serving
    ok, message = eng.update_weights_from_distributed(*request)  # the broken group fails at once
    assert not ok and "failed earlier" in message
    assert eng.destroy_weights_update_group("wg")[0]

    port = free_port()  # alive, joined, never sends: the group's timeout (3 s) ends the wait
    trainer = _slime_trainer(port, 2, "wg", other_model_dir, "silent")
    try:
        _listening(trainer)
        _join([eng], port, "wg", timeout_s=3)
        _layout(trainer)
        start = time.monotonic()
        ok, message = eng.update_weights_from_distributed(*request)
        waited = time.monotonic() - start
    finally:
        trainer.kill()
    assert not ok and "failed within 3 s" in message and 2.5 < waited < 15, (waited, message)
    assert _greedy(eng, prompts) == before
    assert eng.destroy_weights_update_group("wg")[0]

    port = free_port()  # the same name again, a live trainer: the update goes through
    trainer = _slime_trainer(port, 2, "wg", other_model_dir, "tensors")
    try:
        _join([eng], port, "wg")
        _layout(trainer)
        ok, message = eng.update_weights_from_distributed(*request, weight_version="after-reinit")
        assert ok, message
        assert trainer.wait(60) == 0
    finally:
        trainer.kill()
    assert _greedy(eng, prompts) == _greedy(other_engine, prompts)
    assert eng.destroy_weights_update_group("wg")[0]


def test_push_to_two_replicas_through_one_group(engine_factory, other_model_dir, other_engine):
    """tandem's own trainer side: this process is rank 0 (WeightGroup), push_to_engines sends each
    bucket by one flattened broadcast that both engines of the group receive."""
    from trainer_bridge.sync import push_to_engines
    from weight_sync.weight_group import WeightGroup

    engines = [engine_factory(), engine_factory()]
    prompts = random_prompts(2, engines[0].local_core.parts.vocab_size, lengths=(5, 40), seed=20)
    port = free_port()
    joining = threading.Thread(target=_join, args=(engines, port, "push2"))
    joining.start()
    group = WeightGroup("127.0.0.1", port, 0, 3, "push2", backend="gloo", timeout_s=60)
    joining.join()
    named = list(_checkpoint(other_model_dir).items())
    runs = (named[i:i + 7] for i in range(0, len(named), 7))  # a generator: an empty bucket closes the update
    push_to_engines(engines, runs, "p-1", transport="distributed", bucket_bytes=64 << 10,
                    group=group, group_name="push2")
    expected = _greedy(other_engine, prompts)
    for eng in engines:
        assert _greedy(eng, prompts) == expected and eng.get_weight_version() == "p-1"
        assert not eng.local_core.paused and eng.destroy_weights_update_group("push2")[0]
    group.destroy()

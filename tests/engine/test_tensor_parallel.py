"""Tensor parallelism over gloo on the CPU (issue 15): 2 ranks against the unsharded oracle.

Layers and models: two rank processes (the script below) build the parallel layers and the TP=2
models, run them and save their outputs; this process compares them with the unsharded layers
and the TP=1 model. The engine: Engine(tp_size=2) against Engine(tp_size=1), greedy tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from engine.attention.torch_native import TorchNativeAttentionBackend
from engine.models.parallel_state import free_port
from engine.kv.pool import KVPool
from engine.models.loader import load_model
from engine.forward_batch import ForwardBatch, ForwardMode

ROOT = Path(__file__).resolve().parents[2]
TP = 2
# one request, prefilled in two chunks, then decoded token by token: exercises the KV pool per rank
PROMPT = [5, 77, 301, 12, 9, 400, 33, 250, 7, 101, 64, 3]
DECODE = [44, 501, 8]

RANK_SCRIPT = textwrap.dedent('''
    import sys, torch
    sys.path.insert(0, sys.argv[4])
    from test_tensor_parallel import layer_outputs, model_outputs
    from engine.models.parallel_state import TPAddress, TPGroup
    rank, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    tp = TPGroup(TPAddress("127.0.0.1", port, 2, "gloo"), rank)
    torch.save({"layers": layer_outputs(tp, torch.load(f"{work}/ref.pt")), "models": model_outputs(tp, work)},
               f"{work}/rank{rank}.pt")
    tp.gather_objects(rank)  # both ranks done before rank 0's store goes away
    tp.close()  # groups shut down here, not torn apart at exit (rank 0 aborted there: flaky in CI)
''')


def full_tensors() -> dict[str, torch.Tensor]:
    """Unsharded weights and inputs of the layer checks (vocab 509: the last rank is padded)."""
    gen = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return {"x": r(5, 64), "q": r(64, 64), "k": r(32, 64), "v": r(32, 64), "qb": r(64), "kb": r(32), "vb": r(32),
            "gate": r(96, 64), "up": r(96, 64), "o": r(64, 64), "ob": r(64), "xo": r(5, 64),
            "embed": r(509, 64), "ids": torch.tensor([0, 254, 255, 508, 3, 400])}


def layer_outputs(tp, ref: dict) -> dict[str, torch.Tensor]:
    """Run on each rank: the parallel layers loaded through their `rank_part` contract."""
    from engine.models import parallel_layers as pl

    out = {}
    with torch.no_grad():
        qkv = pl.QKVParallelLinear(64, 4, 2, 16, True, False, tp)
        for sid, bias in (("q", "qb"), ("k", "kb"), ("v", "vb")):
            qkv.weight[qkv.shard_slice(sid)] = qkv.rank_part("weight", sid, ref[sid])
            qkv.bias[qkv.shard_slice(sid)] = qkv.rank_part("bias", sid, ref[bias])
        out["qkv"] = torch.cat(qkv(ref["x"]), dim=-1)
        stacked = torch.cat([ref["q"], ref["k"], ref["v"]])  # a whole stacked tensor (engine name)
        out["qkv_whole_ok"] = torch.equal(qkv.rank_part("weight", None, stacked), qkv.weight)
        gate_up = pl.MergedGateUpParallel(64, 96, False, False, tp)
        for sid, name in ((0, "gate"), (1, "up")):
            gate_up.weight[gate_up.shard_slice(sid)] = gate_up.rank_part("weight", sid, ref[name])
        out["gate_up"] = gate_up(ref["x"])
        row = pl.RowParallelLinear(64, 64, True, False, tp)
        row.weight.copy_(row.rank_part("weight", None, ref["o"]))
        row.bias.copy_(row.rank_part("bias", None, ref["ob"]))
        out["row"] = row(ref["xo"].narrow(1, tp.rank * 32, 32))
        embed = pl.VocabParallelEmbedding(509, 64, tp)
        embed.weight.copy_(embed.rank_part("weight", None, ref["embed"]))
        out["embed"] = embed(ref["ids"])
        head = pl.ParallelLMHead(509, 64, False, tp)
        head.weight = embed.weight  # tied, as the tiny model's
        out["lm_head"] = head(ref["x"])
    return out


def model_outputs(tp, work: str) -> dict[str, torch.Tensor]:
    """Logits of the prompt (two chunks) and each decode step, per checkpoint under `work`."""
    out = {}
    for name in ("qwen3", "qwen2"):
        path = f"{work}/{name}"
        config = transformers.AutoConfig.from_pretrained(path)
        model = load_model(path, config, torch.float32, "cpu", "auto", tp=tp)
        out[name] = run_request(model, config, tp.size if tp else 1)
    return out


def run_request(model, config, tp_size: int) -> torch.Tensor:
    from engine.models.parallel_state import kv_heads_per_rank

    kv_heads = kv_heads_per_rank(config.num_key_value_heads, tp_size)
    pool = KVPool(64, config.num_hidden_layers, kv_heads, config.head_dim, torch.float32, "cpu")
    req_to_token = torch.zeros(1, 64, dtype=torch.int64)
    backend = TorchNativeAttentionBackend()
    slots = (torch.arange(63, 0, -1)).tolist()  # scattered: last slots first
    chunks = [PROMPT[:7], PROMPT[7:]] + [[t] for t in DECODE]
    logits, done = [], 0
    for chunk in chunks:
        n = len(chunk)
        loc = torch.tensor(slots[done : done + n])
        req_to_token[0, done : done + n] = loc
        mode = ForwardMode.DECODE if n == 1 else ForwardMode.EXTEND
        fb = ForwardBatch(forward_mode=mode, input_ids=torch.tensor(chunk), positions=torch.arange(done, done + n),
                          out_cache_loc=loc, req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([done + n]),
                          seq_lens_cpu=[done + n], extend_prefix_lens_cpu=[done], extend_seq_lens_cpu=[n],
                          req_to_token=req_to_token, kv_pool=pool, attn_backend=backend)
        backend.init_forward_metadata(fb)
        with torch.inference_mode():
            logits.append(model.compute_logits(model(fb.input_ids, fb.positions, fb)))
        done += n
    return torch.cat(logits)


def _write_qwen2(path: Path) -> None:
    """Qwen2 with q/k/v biases, one kv head (replicated over the ranks), untied, an odd vocab."""
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=1, vocab_size=509, max_position_embeddings=256,
                                      tie_word_embeddings=False, head_dim=16)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # biases and norms that matter
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
    hf.save_pretrained(path)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("tp")
    os.symlink(tiny_model_dir, work / "qwen3")
    _write_qwen2(work / "qwen2")
    torch.save(full_tensors(), work / "ref.pt")
    (work / "rank.py").write_text(RANK_SCRIPT)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(work / "rank.py"), str(r), str(port), str(work),
                               str(Path(__file__).parent)], env=env) for r in range(TP)]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0] * TP, f"rank processes exited with {codes}"
    return work, [torch.load(work / f"rank{r}.pt") for r in range(TP)]


def test_parallel_layers_equal_the_unsharded_layers(rank_results):
    _, ranks = rank_results
    ref = full_tensors()
    x = ref["x"]
    q, k, v = (F.linear(x, ref[n], ref[n + "b"]) for n in "qkv")
    for r, out in enumerate(ranks):  # rank r: q heads 2r, 2r+1 and kv head r
        layers = out["layers"]
        torch.testing.assert_close(layers["qkv"], torch.cat([q[:, 32 * r : 32 * r + 32], k[:, 16 * r : 16 * r + 16],
                                                             v[:, 16 * r : 16 * r + 16]], -1), rtol=0, atol=1e-5)
        assert layers["qkv_whole_ok"]
        gate, up = F.linear(x, ref["gate"]), F.linear(x, ref["up"])
        torch.testing.assert_close(layers["gate_up"], torch.cat([gate[:, 48 * r : 48 * r + 48],
                                                                 up[:, 48 * r : 48 * r + 48]], -1), rtol=0, atol=1e-5)
        torch.testing.assert_close(layers["row"], F.linear(ref["xo"], ref["o"], ref["ob"]), rtol=0, atol=1e-4)
        torch.testing.assert_close(layers["embed"], F.embedding(ref["ids"], ref["embed"]), rtol=0, atol=0)
        torch.testing.assert_close(layers["lm_head"], F.linear(x, ref["embed"]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["qwen3", "qwen2"])
def test_tp2_model_logits_equal_tp1(rank_results, name):
    """Sharded loading from the HF checkpoint + the TP forward = the TP=1 model, on both ranks."""
    work, ranks = rank_results
    config = transformers.AutoConfig.from_pretrained(work / name)
    expected = run_request(load_model(str(work / name), config, torch.float32, "cpu", "auto"), config, 1)
    for out in ranks:
        got = out["models"][name]
        assert got.shape == expected.shape == (len(PROMPT) + len(DECODE), config.vocab_size)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def _greedy(eng, prompts, max_new_tokens=12):
    outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                                            "ignore_eos": True})
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


def _prompts() -> list[list[int]]:
    """A shared 40-token system prefix (radix hits) plus distinct tails; chunks of 16 cut them."""
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 1000, (40,), generator=gen).tolist()
    return [prefix + torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (3, 11, 25)] + [prefix[:9]]


def test_engine_tp2_greedy_tokens_equal_tp1(engine_factory, tiny_model_dir):
    """Radix cache and chunked prefill on (16-token chunks); a second round reuses the cached prefix."""
    import multiprocessing

    from engine import Engine

    common = dict(dtype="float32", device="cpu", chunked_prefill_size=16)
    tp1 = engine_factory(**common)
    expected, _ = _greedy(tp1, _prompts())
    # token_ids_logprob: gathered on rank 0 from the logit rows the ranks computed together
    ids_request = dict(input_ids=_prompts()[:2], sampling_params={"max_new_tokens": 3, "temperature": 0.0},
                       return_logprob=True, logprob_start_len=1, token_ids_logprob=[3, 17, 40])
    want_ids = tp1.generate(**ids_request)
    before = set(multiprocessing.active_children())
    eng = Engine(model_path=tiny_model_dir, tp_size=2, **common)
    try:
        workers = eng.client.core.runner.tp.processes
        assert len(workers) == 1 and workers[0].is_alive()
        first, _ = _greedy(eng, _prompts())
        second, cached = _greedy(eng, _prompts())
        got_ids = eng.generate(**ids_request)
    finally:
        eng.shutdown()
    assert first == expected
    assert second == expected
    for got, want in zip(got_ids, want_ids):
        for key in ("input_token_ids_logprobs", "output_token_ids_logprobs"):
            flat = lambda rows: [e for row in rows if row is not None for e in row]  # noqa: E731 (prompt's first: null)
            assert [e[1] for e in flat(got["meta_info"][key])] == [e[1] for e in flat(want["meta_info"][key])]
            assert [e[0] for e in flat(got["meta_info"][key])] == pytest.approx(
                [e[0] for e in flat(want["meta_info"][key])], abs=1e-4)
    assert min(cached[:3]) >= 40, f"the shared prefix was not reused: cached_tokens {cached}"
    assert not any(p.is_alive() for p in workers)
    assert set(multiprocessing.active_children()) <= before


def test_engine_tp2_weight_updates_equal_an_engine_on_the_new_checkpoint(engine, other_engine, tiny_model_dir,
                                                                         other_model_dir):
    """From disk (every rank reads its shards) and from tensors (a flattened bucket: rank 0 loads,
    then sends the full tensors on); a refused update changes no rank."""
    from safetensors.torch import load_file

    from engine import Engine
    from weight_sync.bucket import FlattenedBucket

    prompts = _prompts()
    old_tokens, new_tokens = _greedy(engine, prompts)[0], _greedy(other_engine, prompts)[0]
    assert old_tokens != new_tokens
    eng = Engine(model_path=tiny_model_dir, tp_size=2, dtype="float32", device="cpu")
    try:
        assert _greedy(eng, prompts)[0] == old_tokens
        ok, message, _ = eng.update_weights_from_disk(other_model_dir, weight_version="disk")
        assert ok, message
        assert _greedy(eng, prompts)[0] == new_tokens
        original = list(load_file(os.path.join(tiny_model_dir, "model.safetensors")).items())
        payload = FlattenedBucket.pack(original).to_payload()
        ok, message = eng.update_weights_from_tensor(payload, load_format="flattened_bucket", weight_version="back")
        assert ok, message
        assert _greedy(eng, prompts)[0] == old_tokens
        bad = [("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64)),  # rank 1's half would load...
               ("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 63))]  # ...but this shape is wrong
        ok, message = eng.update_weights_from_tensor(bad)
        assert not ok and "down_proj" in message
        assert _greedy(eng, prompts)[0] == old_tokens
        assert eng.get_weight_version() == "back"
    finally:
        eng.shutdown()


def test_engine_tp2_overlap_lookahead_steps_equal_tp1(engine, tiny_model_dir, monkeypatch):
    """Overlap scheduling (the GPU default, forced on here): a lookahead step's input ids are the
    previous step's samples, which on a GPU only the device holds; they go to the other ranks by
    a device broadcast, taken here for every lookahead step."""
    from engine import Engine
    from engine.runner import tp_messages

    build = tp_messages.ForwardStep.of.__func__

    def device_only_ids(cls, batch, *args):
        step = build(cls, batch, *args)
        if batch.lookahead:
            step.input_ids = None  # as on a GPU: sent by TPGroup.broadcast_tensor
        return step

    monkeypatch.setattr(tp_messages.ForwardStep, "of", classmethod(device_only_ids))
    prompts = _prompts()
    expected = _greedy(engine, prompts)[0]
    eng = Engine(model_path=tiny_model_dir, tp_size=2, dtype="float32", device="cpu")
    try:
        eng.client.core.overlap = True
        assert _greedy(eng, prompts)[0] == expected
        assert eng.client.core.stats.num_lookahead_steps > 0
    finally:
        eng.shutdown()


@pytest.mark.parametrize("tp_size", [2, 4])
def test_engine_tp_deterministic_mode_is_batch_invariant(tiny_model_dir, tp_size):
    """Batch-invariant kernels on every rank, and all-reduces whose order of summation does not
    depend on the batch (2 ranks: one addition; 4: rank order, as gloo's ring would not keep):
    a request's logprobs are bitwise the same alone and in a batch. TP=4 also replicates the
    tiny model's 2 kv heads."""
    from engine import Engine

    prompts = _prompts()
    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    eng = Engine(model_path=tiny_model_dir, tp_size=tp_size, dtype="float32", device="cpu",
                 enable_deterministic_inference=True)
    try:
        batch = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        alone = eng.generate(input_ids=prompts[2:3], sampling_params=params, return_logprob=True)
    finally:
        eng.shutdown()
    logprobs = lambda out: [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]]  # noqa: E731
    assert batch[2]["output_ids"] == alone[0]["output_ids"]
    assert logprobs(batch[2]) == logprobs(alone[0])


TRAINER = textwrap.dedent("""
    import os, sys, torch
    from safetensors.torch import load_file
    from weight_sync.weight_group import WeightGroup
    port, path = int(sys.argv[1]), sys.argv[2]
    group = WeightGroup("127.0.0.1", port, 0, 3, "wg", backend="gloo", timeout_s=60)  # trainer + 2 TP ranks
    for _ in range(2):  # the first time refused (weights released): every rank receives and drops it
        for _, tensor in load_file(path).items():
            group.broadcast(tensor.contiguous(), src=0)
    group.broadcast(torch.ones(3), src=0)  # the second update: an unknown name, refused by every rank
    print("trainer done", flush=True)
    os._exit(0)  # no gloo teardown: the engine may have left the group already
""")


def test_engine_tp2_broadcast_update_reaches_every_rank(other_engine, tiny_model_dir, other_model_dir):
    """A trainer's group of 3: the trainer, then the engine's ranks as rank_offset + t (SGLang's
    numbering); each rank receives the broadcast and loads its shards, or drops it when the update
    is refused (the next update still pairs with the trainer's broadcasts)."""
    from safetensors.torch import load_file

    from engine import Engine

    prompts = _prompts()
    expected = _greedy(other_engine, prompts)[0]
    named = list(load_file(os.path.join(other_model_dir, "model.safetensors")).items())
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    eng = Engine(model_path=tiny_model_dir, tp_size=2, dtype="float32", device="cpu")
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), os.path.join(other_model_dir,
                               "model.safetensors")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        ok, message = eng.init_weights_update_group("127.0.0.1", port, 1, 3, "wg", backend="gloo")
        assert ok, message
        specs = ([n for n, _ in named], [str(t.dtype) for _, t in named], [list(t.shape) for _, t in named], "wg")
        assert eng.release_memory_occupation(tags=["weights"])[0]
        ok, message = eng.update_weights_from_distributed(*specs, weight_version="refused")
        assert not ok and "weights are released" in message
        assert eng.resume_memory_occupation(tags=["weights"])[0]
        ok, message = eng.update_weights_from_distributed(*specs, weight_version="dist")
        assert ok, message
        assert _greedy(eng, prompts)[0] == expected
        ok, message = eng.update_weights_from_distributed(["model.nope.weight"], ["float32"], [[3]], "wg")
        assert not ok and "unknown weight 'model.nope.weight'" in message, message
        assert trainer.wait(timeout=60) == 0, trainer.stdout.read()
        assert eng.destroy_weights_update_group("wg")[0]
        assert _greedy(eng, prompts)[0] == expected and eng.get_weight_version() == "dist"
    finally:
        trainer.kill()
        eng.shutdown()

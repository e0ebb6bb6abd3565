"""`tandem train` failing the way a new user makes it fail: each is one line naming what to change and
exit status 1 (refused before the run folder when it can be known up front), never a traceback."""

from __future__ import annotations

import os
import sys

import pytest

from tandem.main import main

FAST = ["--engine-backend", "in_process", "--num-engines", "1", "--steps", "1", "--prompts-per-step", "2",
        "--warm-start-steps", "0", "--wandb", "false", "--save-checkpoint", "false", "--quiet"]

PLUGINS = '''
import math

def task_raises(**kw):
    raise RuntimeError("no dataset")

def reward_big(sample):
    return 5.0

def reward_nan(sample):
    return math.nan

def reward_two(sample, other):
    return 1.0

async def rollout_raises(ctx):
    raise ConnectionError("tool server down")

async def rollout_dict(ctx):
    return {"text": "7"}

def rollout_sync(ctx):
    return None
'''


def _exit_message(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert isinstance(exc.value.code, str), exc.value.code  # sys.exit(message): status 1
    assert "\n" not in exc.value.code
    return exc.value.code


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """A user's plug-in module in the working directory, imported as `tandem train` would."""
    name = f"user_plugins_{os.getpid()}_{len(sys.modules)}"
    (tmp_path / f"{name}.py").write_text(PLUGINS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_object appends the cwd: undone after
    return name


@pytest.mark.parametrize("flags,message", [
    (["--task-args", '{"nope": 1}'], "task 'rollout.tasks:addition' does not take task_args {'nope': 1}"),
    (["--task-args", '{"max_operand": -1}'], "task 'rollout.tasks:addition': max_operand must be an integer >= 0"),
    (["--device", "cuda"], "device 'cuda' needs a CUDA GPU, but "),
    (["--device", "cuda:1"], "device 'cuda:1' needs a CUDA GPU, but "),
    (["--trainer", "deepspeed"], "trainer 'deepspeed' runs on CUDA GPUs: on the CPU use --trainer torch"),
    (["--recipe", "qwen3_gpu"], "device 'cuda' needs a CUDA GPU, but "),
    (["--temperature", "0"], "temperature must be a finite number > 0"),
    (["--seed", str(1 << 64)], "seed must be < 2**64 (torch's generator takes 64 bits), got 18446744073709551616"),
    (["--engine-args", '{"attention_backend": "flashinfer"}'], "engine_args: attention_backend 'flashinfer' has no "
                                                               "deterministic mode"),
    (["--engine-args", '{"attention_backend": "flashinfer"}', "--deterministic", "false"],
     "engine_args: attention_backend 'flashinfer': the trainer recomputes the rollout logprobs with torch or triton"),
])
def test_refused_before_the_run_folder(tmp_path, flags, message):
    out = tmp_path / "run"
    text = _exit_message(["train", *FAST, "--output-dir", str(out), *flags])
    assert text.startswith(f"tandem train: {message}"), text
    assert not out.exists()


@pytest.mark.parametrize("flags,message", [
    (["--task", "{m}:task_raises"], "task '{m}:task_raises' raised RuntimeError: no dataset ({m}.py, line 5)"),
    (["--reward", "{m}:reward_two"], "reward '{m}:reward_two' must take one argument (the Sample); its signature "
                                     "is reward_two(sample, other)"),
    (["--rollout-fn", "{m}:rollout_sync"], "rollout_fn '{m}:rollout_sync' must be an async function: "
                                           "`async def fn(ctx) -> Sample` (recipes/multi_turn.py)"),
])
def test_bad_plugins_are_refused_before_the_run_folder(tmp_path, plugins, flags, message):
    out = tmp_path / "run"
    flags = [f.format(m=plugins) for f in flags]
    text = _exit_message(["train", *FAST, "--output-dir", str(out), *flags])
    assert text == f"tandem train: {message.format(m=plugins)}"
    assert not out.exists()


@pytest.mark.parametrize("flags,message", [
    (["--reward", "{m}:reward_big"], "reward '{m}:reward_big' returned 5.0 for the response "),
    (["--reward", "{m}:reward_nan"], "reward '{m}:reward_nan' returned nan for the response "),
    (["--rollout-fn", "{m}:rollout_raises"], "rollout_fn '{m}:rollout_raises' raised ConnectionError: tool server "
                                             "down ({m}.py, line 17)"),
    (["--rollout-fn", "{m}:rollout_dict"], "rollout_fn '{m}:rollout_dict' returned dict, not a Sample"),
])
def test_plugins_failing_in_the_first_step(tmp_path, plugins, flags, message, capsys):
    out = tmp_path / "run"
    text = _exit_message(["train", *FAST, "--output-dir", str(out), *[f.format(m=plugins) for f in flags]])
    assert text.startswith(f"tandem train: {message.format(m=plugins)}"), text
    assert (out / "metrics.jsonl").read_text() == ""  # the step never finished
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(  # the line above the error
        f"tandem train: stopped by an error after 0 of 1 steps; the partial run is in {out} (metrics.jsonl")


def test_output_dir_not_empty_file_or_unwritable(tmp_path, monkeypatch):
    full = tmp_path / "full"
    full.mkdir()
    (full / "metrics.jsonl").write_text('{"step": 1}\n')
    assert _exit_message(["train", *FAST, "--output-dir", str(full)]) == (
        f"tandem train: --output-dir {full} is not empty (metrics.jsonl): pass a new folder, or remove this one to "
        f"run there again")
    assert (full / "metrics.jsonl").read_text() == '{"step": 1}\n'  # the earlier run is untouched
    afile = tmp_path / "afile"
    afile.write_text("")
    assert _exit_message(["train", *FAST, "--output-dir", str(afile)]) == (
        f"tandem train: --output-dir {afile} is a file, not a folder: pass a new folder's path")
    text = _exit_message(["train", *FAST, "--output-dir", "/proc/tandem-run"])
    assert text == "tandem train: --output-dir /proc/tandem-run: cannot create it (No such file or directory); " \
                   "pass a writable path"
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a user without write permission (tests run as root)
    assert _exit_message(["train", *FAST, "--output-dir", str(tmp_path / "new")]) == (
        f"tandem train: --output-dir {tmp_path / 'new'}: this user cannot create folders in {tmp_path}; pass a "
        f"writable path")


def test_an_empty_existing_output_dir_is_used(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["train", *FAST, "--output-dir", str(out)]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_triton_attention_on_the_cpu_needs_its_interpreter(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    text = _exit_message(["train", *FAST, "--output-dir", str(tmp_path / "run"), "--engine-args",
                          '{"attention_backend": "triton"}'])
    assert text == ("tandem train: engine_args: attention_backend 'triton' on the CPU needs TRITON_INTERPRET=1 "
                    "(Triton's interpreter, slow); leave it out to use torch attention there")


def test_an_engine_error_fails_the_step_with_its_message(monkeypatch):
    """Oracle: a real engine failing every forward (Triton attention off CUDA, no interpreter), which
    aborts each request with "engine error: ..."; the step was reported as an empty batch."""
    from transformers import AutoTokenizer

    from engine import Engine
    from engine.testing.tiny_model import tiny_model_path
    from recipes.recipe import Recipe
    from tandem.rl.rollouts import Rollouts
    from rollout.rewards import exact_match
    from rollout.tasks import addition

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = str(tiny_model_path())
    engine = Engine(model_path=path, device="cpu", attention_backend="triton", log_level="critical")
    try:
        rollouts = Rollouts(Recipe(prompts_per_step=2, n_per_prompt=2), [engine],
                            AutoTokenizer.from_pretrained(path), addition(5), exact_match)
        with pytest.raises(ValueError) as exc:
            rollouts.generate(1)
    finally:
        engine.shutdown()
    assert str(exc.value) == ("step 1: an engine failed a rollout (engine error: RuntimeError: attention_backend "
                              "'triton' needs a CUDA device (or TRITON_INTERPRET=1)); its log above has the traceback")


def test_an_engine_that_cannot_start_is_one_line(tmp_path):
    """A KV pool far beyond memory (a RuntimeError from torch's allocator, no check names it)."""
    text = _exit_message(["train", *FAST, "--output-dir", str(tmp_path / "run"), "--engine-args",
                          '{"context_length": 10000000}'])
    assert text.startswith("tandem train: the engines did not start: RuntimeError: ")
    assert "can't allocate memory" in text
    assert text.endswith("(check --engine-args and free memory; TANDEM_DEBUG=1 shows the traceback)")


def test_a_model_folder_without_weights_or_tokenizer_is_refused_up_front(tmp_path):
    import shutil

    from engine.testing.tiny_model import tiny_model_path

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(tiny_model_path() / "config.json", model)
    out = tmp_path / "run"
    assert _exit_message(["train", *FAST, "--model", str(model), "--output-dir", str(out)]) == (
        f"tandem train: model {str(model)!r} has a config.json but no *.safetensors weights: tandem loads "
        f"safetensors checkpoints (an HF download of the model has them)")
    shutil.copy(tiny_model_path() / "model.safetensors", model)
    assert _exit_message(["train", *FAST, "--model", str(model), "--output-dir", str(out)]).startswith(
        f"tandem train: model {str(model)!r} has no tokenizer (tokenizer.json, tokenizer_config.json")
    assert not out.exists()


def test_engines_capture_graphs_up_to_the_rollout_batch_only():
    """A colocated step re-captures the engine's CUDA graphs on every resume: only the sizes a
    rollout can reach (issue 25: 51 graphs were ~4.4 s of a 0.6B step); engine_args still win."""
    import dataclasses

    from recipes.qwen3_gpu import RECIPE
    from tandem.rl.engines import engine_kwargs, rollout_graph_max_bs
    from tandem.rl.model_source import ModelSource

    source = ModelSource("/nowhere", "dummy", "test")
    assert rollout_graph_max_bs(RECIPE) == 128 == engine_kwargs(RECIPE, source)["cuda_graph_max_bs"]
    assert rollout_graph_max_bs(dataclasses.replace(RECIPE, prompts_per_step=3, n_per_prompt=3)) == 16
    assert rollout_graph_max_bs(dataclasses.replace(RECIPE, prompts_per_step=64, n_per_prompt=16)) == 512
    own = dataclasses.replace(RECIPE, engine_args={**RECIPE.engine_args, "cuda_graph_max_bs": 8})
    assert engine_kwargs(own, source)["cuda_graph_max_bs"] == 8


def test_deterministic_lora_rl_engines_run_the_trainers_lora_code():
    """Deterministic LoRA RL: the engines add adapter deltas with the torch path, the code the
    trainer differentiates (the pool's kernels are batch-invariant but not the trainer's bits);
    normal mode keeps the pool; engine_args still win."""
    import dataclasses

    from recipes.qwen3_gpu import RECIPE
    from tandem.rl.engines import engine_kwargs
    from tandem.rl.model_source import ModelSource

    source = ModelSource("/nowhere", "dummy", "test")
    lora = dataclasses.replace(RECIPE, lora_rank=16, deterministic=True, trainer="torch")
    assert engine_kwargs(lora, source)["lora_backend"] == "torch_native"
    assert "lora_backend" not in engine_kwargs(dataclasses.replace(lora, deterministic=False), source)
    own = dataclasses.replace(lora, engine_args={**RECIPE.engine_args, "lora_backend": "grouped"})
    assert engine_kwargs(own, source)["lora_backend"] == "grouped"

"""A careless `tandem` user: a bad flag value, path or plug-in is one line saying what to change and
exit status 1, never a traceback; `tandem train` refuses before it starts a trainer or an engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.main import main


@pytest.fixture(scope="module")
def tiny_model_dir() -> str:
    from engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path())  # the cached build `tandem train` uses


def _exit_message(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert isinstance(exc.value.code, str), exc.value.code  # sys.exit(message): status 1
    return exc.value.code


@pytest.mark.parametrize("flags,message", [
    (["--reward", "nope.module:fn"], "tandem train: reward 'nope.module:fn': cannot import 'nope.module'"),
    (["--reward", "rollout.rewards:nope"], "tandem train: reward 'rollout.rewards:nope': 'rollout.rewards' has no "
                                           "callable 'nope'"),
    (["--task", "nope"], "tandem train: task 'nope': use 'module:function'"),
    (["--rollout-fn", "recipes.nope:f"], "tandem train: rollout_fn 'recipes.nope:f': cannot import"),
    (["--temperature", "nan"], "tandem train: temperature must be a finite number > 0"),
    (["--lr", "-1"], "tandem train: lr must be a finite number > 0, got -1.0"),
    (["--tis-cap", "0"], "tandem train: tis_cap must be a finite number > 0, got 0.0"),
    (["--warm-start-steps", "-3"], "tandem train: warm_start_steps must be >= 0, got -3"),
    (["--zero-stage", "7"], "tandem train: zero_stage must be 0, 1, 2 or 3, got 7"),
    (["--steps", "-1"], "tandem train: steps must be >= 1, got -1"),
    (["--engine-args", '{"bogus_knob": 1}'], "tandem train: engine_args: unknown ServerArgs field(s): bogus_knob"),
    (["--engine-args", '{"schedule_policy": "random"}'], "tandem train: engine_args: schedule_policy must be one of"),
    (["--dtype", "float99"], "tandem train: dtype must name a torch dtype"),
    (["--device", "tpu"], "tandem train: device 'tpu' is not a torch device"),
    (["--aggregation", "nope"], "tandem train: aggregation must be one of token_mean"),
    (["--transport", "nope"], "tandem train: transport must be one of tensor, disk; got 'nope'"),
    (["--model", "/no/such/model"], "tandem train: model '/no/such/model' is neither a preset"),
    (["--recipe", "/no/such/recipe.py"], "tandem train: recipe file /no/such/recipe.py does not exist"),
    # issue 27: a billion prompts per step built 4.8 GB of them in 60 s before any check
    (["--prompts-per-step", "1000000000"], "tandem train: prompts_per_step must be <= 16,384, got 1,000,000,000"),
    (["--warm-start-batch", "1e9"], "tandem train: warm_start_batch must be <= 16,384, got 1,000,000,000"),
    (["--prompts-per-step", "8192", "--n-per-prompt", "16"],
     "tandem train: prompts_per_step x n_per_prompt = 131,072 samples per step; the limit is 65,536"),
    (["--task-args", "[" * 5000 + "]" * 5000], "tandem train: --task-args: cannot read '[[[["),
])
def test_bad_train_overrides_are_one_line_before_anything_starts(tmp_path, flags, message):
    out = tmp_path / "run"
    text = _exit_message(["train", *flags, "--engine-backend", "in_process", "--quiet", "--output-dir", str(out)])
    assert text.startswith(message), text
    assert "\n" not in text and not out.exists()  # refused before the run folder, trainer or engines


def test_train_output_dir_under_a_file(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    text = _exit_message(["train", "--engine-backend", "in_process", "--quiet", "--output-dir", str(blocker / "run")])
    assert text.startswith("tandem train: ") and "Not a directory" in text


def test_engine_commands_name_a_missing_model_path(tmp_path):
    missing = str(tmp_path / "nope")
    text = _exit_message(["generate", "--model-path", missing, "--prompt", "hi"])
    assert text == (f"tandem generate: model_path {missing!r} does not exist: pass a local HF checkpoint directory "
                    "(build a small one with `tandem tiny-model --out DIR`)")
    text = _exit_message(["generate", "--model-path", str(tmp_path), "--prompt", "hi"])
    assert text.startswith(f"tandem generate: model_path {str(tmp_path)!r} has no config.json")


@pytest.mark.parametrize("flags,message", [
    (["--port", "-5"], "tandem serve: port must be in [0, 65535], got -5"),
    (["--port", "70000"], "tandem serve: port must be in [0, 65535], got 70000"),
    (["--device", "tpu"], "tandem serve: device 'tpu' is not a torch device: use auto, cpu, cuda or cuda:N"),
    (["--mem-fraction-static", "5"], "tandem serve: mem_fraction_static must be in (0, 1), got 5.0"),
])
def test_bad_serve_flags_are_one_line(tiny_model_dir, flags, message):
    assert _exit_message(["serve", "--model-path", tiny_model_dir, *flags]) == message


def test_generate_with_a_bad_sampling_value_is_one_line(tiny_model_dir):
    text = _exit_message(["generate", "--model-path", tiny_model_dir, "--prompt", "hi", "--temperature", "nan"])
    assert text == "tandem generate: temperature must be a finite number, got nan"


def test_the_console_shows_no_traceback_and_exits_1(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tandem.main", "train", "--reward", "nope.module:fn",
                           "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("tandem train: reward 'nope.module:fn': cannot import")


def test_tandem_debug_shows_the_traceback(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_DEBUG", "1")
    with pytest.raises(ValueError, match="cannot import 'nope.module'"):
        main(["train", "--reward", "nope.module:fn", "--output-dir", str(tmp_path / "run")])

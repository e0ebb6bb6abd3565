"""The `tandem` command line: tiny-model end to end, ServerArgs flags, handler dispatch."""

from __future__ import annotations

import dataclasses
import json
import sys
import types

import pytest

from tandem import main as cli
from engine.config import ServerArgs
from tandem.server_args import flag_name, server_args_from_namespace


def _server_args(argv: list[str]) -> ServerArgs:
    return ServerArgs(**server_args_from_namespace(cli.build_parser().parse_args(argv)))


def test_tiny_model_subcommand(tmp_path, capsys):
    assert cli.main(["tiny-model", "--out", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert str(tmp_path / "m") in capsys.readouterr().out


def test_tiny_model_real_shape_preset(tmp_path):
    assert cli.main(["tiny-model", "--out", str(tmp_path), "--preset", "qwen3-8b"]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 36
    assert not (tmp_path / "model.safetensors").exists()


def test_every_server_args_field_has_a_flag():
    sub = cli.build_parser()._subparsers._group_actions[0].choices
    for command in ("generate", "demo", "serve"):
        flags = sub[command]._option_string_actions
        for field in dataclasses.fields(ServerArgs):
            assert flag_name(field.name) in flags, (command, field.name)


def test_defaults_round_trip():
    assert _server_args(["generate", "--model-path", "m", "--prompt", "x"]) == ServerArgs(model_path="m")


def test_flags_round_trip():
    args = _server_args([
        "serve", "--model-path", "/ckpt", "--chunked-prefill-size", "64", "--disable-radix-cache",
        "--schedule-policy", "lpm", "--mem-fraction-static", "0.5", "--attention-backend", "torch",
        "--enable-deterministic-inference", "--port", "31000", "--dtype", "float32",
    ])
    assert args == ServerArgs(model_path="/ckpt", chunked_prefill_size=64, disable_radix_cache=True,
                              schedule_policy="lpm", mem_fraction_static=0.5,
                              attention_backend="torch", enable_deterministic_inference=True,
                              port=31000, dtype="float32")


def test_generate_sampling_flags():
    ns = cli.build_parser().parse_args([
        "generate", "--model-path", "m", "--prompt", "a", "--prompt", "b c",
        "--max-new-tokens", "8", "--temperature", "0.7", "--sampling-seed", "5"])
    assert (ns.prompt, ns.max_new_tokens, ns.temperature, ns.sampling_seed) == (["a", "b c"], 8, 0.7, 5)


def test_demo_needs_no_model_path():
    ns = cli.build_parser().parse_args(["demo", "--max-total-tokens", "512"])
    kwargs = server_args_from_namespace(ns)
    assert "model_path" not in kwargs and kwargs["max_total_tokens"] == 512


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "x"],  # --model-path is required
    ["serve", "--model-path", "m", "--schedule-policy", "random"],
    ["serve", "--model-path", "m", "--max-total-tokens", "lots"],
    ["tiny-model", "--out", "x", "--preset", "gpt-5"],
])
def test_bad_flags_exit(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(argv)
    assert exc.value.code == 2


def test_dispatch_calls_handler_with_namespace(monkeypatch):
    seen = {}

    def run_generate(args):
        seen["args"] = args
        return 0

    from tandem import generate

    fake = types.ModuleType("tandem.generate")
    fake.add_generate_arguments, fake.add_demo_arguments = generate.add_generate_arguments, generate.add_demo_arguments
    fake.run_generate = run_generate
    monkeypatch.setitem(sys.modules, "tandem.generate", fake)
    assert cli.main(["generate", "--model-path", "m", "--prompt", "hi"]) == 0
    assert seen["args"].prompt == ["hi"] and seen["args"].model_path == "m"


def test_missing_handler_module_is_a_clear_error(monkeypatch):
    missing = dataclasses.replace(cli.COMMANDS["serve"], runner="engine.no_such_module:run_serve")
    monkeypatch.setitem(cli.COMMANDS, "serve", missing)
    with pytest.raises(SystemExit, match="not available"):
        cli.main(["serve", "--model-path", "m"])


def test_serve_runs_the_core_in_a_process_on_a_gpu_unless_told(monkeypatch):
    import torch

    from tandem import serve
    from tandem.serve import default_core_process

    monkeypatch.setattr(serve, "nvml_gpu_count", lambda: None)  # no NVML: torch decides

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_core_process({"device": "auto"})["core_process"] is True
    assert default_core_process({"device": "cpu"})["core_process"] is False
    assert default_core_process({"core_process": False})["core_process"] is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_core_process({})["core_process"] is False
    assert default_core_process({"core_process": True})["core_process"] is True


class FakeNvml:
    """libnvidia-ml's three calls the serve command makes, for a machine with `gpus` GPUs."""

    def __init__(self, gpus: int, init_status: int = 0) -> None:
        self.gpus, self.init_status, self.shut = gpus, init_status, False

    def nvmlInit_v2(self) -> int:
        return self.init_status

    def nvmlDeviceGetCount_v2(self, count_ref) -> int:
        count_ref._obj.value = self.gpus
        return 0

    def nvmlShutdown(self) -> int:
        self.shut = True
        return 0


def test_serve_asks_nvml_before_importing_torch(monkeypatch):
    """The GPU check that decides the core's process runs before the core is spawned: NVML, not torch."""
    import ctypes

    from tandem import serve

    fake = FakeNvml(2)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    assert serve.nvml_gpu_count({}) == 2 and fake.shut
    assert serve.nvml_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert serve.nvml_gpu_count({"CUDA_VISIBLE_DEVICES": "-1"}) == 0
    assert serve.nvml_gpu_count({"CUDA_VISIBLE_DEVICES": "-1,0"}) == 0  # CUDA stops at the first invalid entry
    assert serve.nvml_gpu_count({"CUDA_VISIBLE_DEVICES": "none"}) == 0
    assert serve.nvml_gpu_count({"CUDA_VISIBLE_DEVICES": "1,0"}) == 2
    assert serve.nvml_gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-5e1c"}) == 2
    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeNvml(2, init_status=9))
    assert serve.nvml_gpu_count({}) is None  # NVML would not start: torch decides

    def no_library(name):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert serve.nvml_gpu_count({}) is None
    monkeypatch.setattr(serve, "nvml_gpu_count", lambda: 1)
    assert serve.default_core_process({"device": "auto"})["core_process"] is True
    monkeypatch.setattr(serve, "nvml_gpu_count", lambda: 0)
    assert serve.default_core_process({"device": "auto"})["core_process"] is False


def test_serve_stops_the_early_core_when_the_engine_fails(monkeypatch):
    import engine.api.engine
    import tandem.server_args
    from tandem import serve

    class Spawned:
        killed = False

        def kill(self):
            Spawned.killed = True

    class Broken:
        def __init__(self, **kwargs):
            raise RuntimeError("no engine today")

    monkeypatch.setattr(tandem.server_args, "server_args_from_namespace", lambda args: {"core_process": True})
    monkeypatch.setattr(serve, "_spawn_core_early", lambda kwargs: Spawned())
    monkeypatch.setattr(engine.api.engine, "Engine", Broken)
    with pytest.raises(RuntimeError, match="no engine today"):
        serve.run_serve(None)
    assert Spawned.killed


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_handler", lambda command: interrupted)
    monkeypatch.delenv("TANDEM_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["tiny-model", "--out", "/tmp/unused"])
    assert exit_.value.code == 130
    assert capsys.readouterr().err.strip() == "tandem tiny-model: interrupted"


def test_serve_reaches_its_core_spawn_without_importing_torch(tmp_path):
    """`tandem serve` spawns its core process first; parsing its flags must not import torch (an
    unrelated command's flag adder did: seconds on a fresh machine before the core started)."""
    import subprocess

    probe = ("import sys\nimport tandem.serve as serve\n"
             "def spawned(kwargs):\n"
             "    print('torch' in sys.modules, 'transformers' in sys.modules)\n"
             "    raise SystemExit(0)\n"
             "serve._spawn_core_early = spawned\n"
             "from tandem.main import main\n"
             f"main(['serve', '--model-path', {str(tmp_path)!r}, '--core-process'])\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"]


def test_only_the_named_commands_flags_are_built():
    sub = cli.build_parser(only="serve")._subparsers._group_actions[0].choices
    assert "--model-path" in sub["serve"]._option_string_actions
    assert set(sub["bench-sync"]._option_string_actions) == {"-h", "--help"}
    assert set(sub) == set(cli.COMMANDS)  # every command still listed

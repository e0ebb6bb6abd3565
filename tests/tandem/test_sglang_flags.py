"""SGLang's launch flags on tandem's command line: an SGLang launch command starts tandem where its
flags change nothing here, and a flag that would change something is refused by name with what
to do; --weight-version is the engine's first weight version (a ServerArgs field)."""

from __future__ import annotations

import argparse
import logging

import pytest

from tandem.server_args import add_server_args, server_args_from_namespace


def _parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_server_args(parser, require_model_path=False)
    return server_args_from_namespace(parser.parse_args(list(argv)))


def test_flags_that_change_nothing_start_and_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="tandem"):
        kwargs = _parse("--trust-remote-code", "--enable-metrics", "--skip-server-warmup", "--nccl-port", "30010",
                        "--base-gpu-id", "0", "--dp-size", "1", "--kv-cache-dtype", "auto", "--page-size", "1",
                        "--cuda-graph-bs", "1", "2", "4", "--watchdog-timeout", "300.5", "--weight-version", "step-3",
                        "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3")
    assert (kwargs["weight_version"], kwargs["tool_call_parser"], kwargs["reasoning_parser"]) == ("step-3", "qwen25", "qwen3")
    assert not any(key.startswith("sglang") or key in ("trust_remote_code", "page_size") for key in kwargs)
    assert "--trust-remote-code" in caplog.text and "--cuda-graph-bs" in caplog.text


@pytest.mark.parametrize("argv, named", [
    (("--kv-cache-dtype", "fp8_e5m2"), "kv_cache_dtype='fp8_e5m2'"),
    (("--page-size", "16"), "page_size=16"),
    (("--dp-size", "2"), "dp_size=2"),
    (("--allow-auto-truncate",), "allow_auto_truncate=True"),
    (("--chat-template", "chatml"), "chat_template='chatml'"),
])
def test_flags_that_would_change_something_are_refused_by_name(argv, named):
    with pytest.raises(ValueError, match=named):
        _parse(*argv)


def test_a_tool_call_format_tandem_does_not_parse_is_refused(capsys):
    with pytest.raises(SystemExit):
        _parse("--tool-call-parser", "llama3")
    err = capsys.readouterr().err
    assert "--tool-call-parser: invalid choice: 'llama3'" in err and "qwen25" in err


def test_weight_version_is_the_engine_s_first(tiny_model_dir):
    from engine import Engine

    with Engine(model_path=tiny_model_dir, dtype="float32", device="cpu", weight_version="ckpt-7") as eng:
        out = eng.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1, "temperature": 0.0})
        assert out["meta_info"]["weight_version"] == "ckpt-7" and eng.get_weight_version() == "ckpt-7"
    with pytest.raises(ValueError, match="weight_version must be a string"):
        Engine(model_path=tiny_model_dir, dtype="float32", device="cpu", weight_version=7)
    # every reply carries it: checked as an update's weight_version is (a lone surrogate broke every JSON reply)
    for bad, named in (("a\nb", "control character"), ("\ud800", "lone surrogate"), ("v" * 300, "at most 256")):
        with pytest.raises(ValueError, match=named):
            Engine(model_path=tiny_model_dir, dtype="float32", device="cpu", weight_version=bad)

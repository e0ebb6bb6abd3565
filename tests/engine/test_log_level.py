"""ServerArgs.log_level: checked, settable with --log-level, applied when an Engine starts."""

import argparse
import logging

import pytest

from tandem.server_args import add_server_args, server_args_from_namespace
from engine.config import ServerArgs


@pytest.fixture
def saved_levels():
    loggers = [logging.getLogger(name) for name in ("tandem", "engine")]
    levels = [lg.level for lg in loggers]
    yield
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)


def test_a_bad_level_is_refused():
    with pytest.raises(ValueError, match="log_level must be one of debug, info, warning, error, critical; got 'loud'"):
        ServerArgs(model_path="m", log_level="loud")


def test_the_cli_flag_sets_it():
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    kwargs = server_args_from_namespace(parser.parse_args(["--model-path", "m", "--log-level", "warning"]))
    assert ServerArgs(**kwargs).log_level == "warning"
    with pytest.raises(SystemExit):  # argparse names the choices
        parser.parse_args(["--model-path", "m", "--log-level", "loud"])


def test_an_engine_applies_it_at_start(engine_factory, saved_levels):
    engine_factory(log_level="error")
    assert logging.getLogger("tandem").level == logging.ERROR
    assert logging.getLogger("engine.core.control").getEffectiveLevel() == logging.ERROR
    engine_factory(log_level="debug")
    assert logging.getLogger("tandem").level == logging.DEBUG

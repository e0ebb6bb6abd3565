"""SGLang's launch flags that `tandem serve` (and every command taking the engine settings) accepts
beside ServerArgs' own: a launch command written for SGLang starts tandem unchanged where a flag
changes nothing here, and names the flag with what to do where it would (the tables of
engine/sglang_launch_args.py, which sglang.Engine's keyword arguments go through too)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from engine.sglang_launch_args import IGNORED, LISTS, NEUTRAL, NOT_FLAGS, SWITCHES, drop_sglang_launch_args

logger = logging.getLogger("tandem")
_DEST = "sglang_launch__"


def add_sglang_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SGLang launch flags", "taken where they change nothing here "
                                      "(ignored), refused by name where they would")
    for name in [*NEUTRAL, *IGNORED]:
        flag = "--" + name.replace("_", "-")
        if name in NOT_FLAGS or flag in parser._option_string_actions:
            continue
        if name in SWITCHES:
            group.add_argument(flag, dest=_DEST + name, action="store_true", help=argparse.SUPPRESS)
        else:
            group.add_argument(flag, dest=_DEST + name, nargs="*" if name in LISTS else None, type=_scalar,
                               default=None, help=argparse.SUPPRESS)


def check_sglang_flags(ns: argparse.Namespace) -> None:
    """The SGLang flags given: a ValueError naming one that asks for what tandem does not do; the
    rest are logged once as ignored."""
    given = {key[len(_DEST):]: value for key, value in vars(ns).items()
             if key.startswith(_DEST) and value not in (None, False)}
    drop_sglang_launch_args(dict(given))
    if given:
        logger.info("SGLang launch flags with no effect in tandem, ignored: %s",
                    " ".join("--" + name.replace("_", "-") for name in given))


def _scalar(text: str) -> Any:
    """A flag's value as SGLang's parser would type it: an int or a float where it reads as one."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text

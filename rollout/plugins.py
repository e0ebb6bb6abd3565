"""load_object: plug-ins (task factory, reward, rollout function) by dotted path, for recipes and rollouts.

A plug-in is the user's code: whatever it raises (importing it or calling it) becomes one
ValueError naming the recipe field, the dotted path and the line it failed at, which the CLI
prints as one line (TANDEM_DEBUG=1 shows the traceback, chained as the cause).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from typing import Any


def load_object(path: str, what: str) -> Any:
    """"module:name" (or "module.name") -> the callable; errors name the recipe field `what`."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {path!r}: use 'module:function' (or 'module.function')")
    module = _import(module_name, path, what)
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ValueError(f"{what} {path!r}: {module_name!r} has no callable {attr!r}")
    return obj


def _import(module_name: str, path: str, what: str) -> Any:
    try:
        return _import_from_cwd_too(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: cannot import {module_name!r} ({exc})") from exc
    except Exception as exc:  # the module itself fails: a syntax error, an error at import time
        raise plugin_error(what, path, exc, "while importing") from exc


def _import_from_cwd_too(module_name: str) -> Any:
    """As `python -m` would: a module in the working directory imports even through the `tandem`
    script, whose sys.path starts at its bin/ folder."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        top = module_name.split(".")[0]
        if exc.name != top or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)  # after everything installed: a local file never shadows a package
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as again:
            if again.name == top:
                sys.path.remove(cwd)
            raise exc from None


def plugin_error(what: str, path: str, exc: BaseException, doing: str = "") -> ValueError:
    """The user's code failed: "reward 'pkg:fn' raised KeyError: 'x' (pkg.py, line 12)"."""
    if isinstance(exc, SyntaxError):
        return ValueError(f"{what} {path!r}: {exc.filename}, line {exc.lineno}: SyntaxError: {exc.msg}")
    doing = f" {doing}" if doing else ""
    if isinstance(exc, ValueError):  # a refused value: its message says what (tasks check their arguments)
        return ValueError(f"{what} {path!r}{doing}: {exc}{_where(exc)}")
    return ValueError(f"{what} {path!r} raised {type(exc).__name__}{doing}: {exc}{_where(exc)}")


def check_arity(fn: Any, what: str, path: str, arguments: str) -> None:
    """fn must take exactly one positional argument (`arguments` names it for the message)."""
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        raise ValueError(f"{what} {path!r} must take one argument ({arguments}); its signature is "
                         f"{getattr(fn, '__name__', 'fn')}{inspect.signature(fn)}") from None
    except ValueError:  # no signature to read (a builtin): the call decides
        pass


def _where(exc: BaseException) -> str:
    """The last line the error passed in the user's own files (not the standard library's or an
    installed package's), else the last line it passed."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    libraries = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    own = [f for f in frames if not f.filename.startswith(libraries)] or frames
    if not own:
        return ""
    name = os.path.relpath(own[-1].filename)
    return f" ({own[-1].filename if name.startswith('..') else name}, line {own[-1].lineno})"

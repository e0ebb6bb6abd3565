"""A compile worker: a child process that compiles grammars to check them, one at a time.

engine/grammar/compile_pool.py starts it (through ServerProcess) and kills it when a compile runs
over its time limit: a compile inside xgrammar cannot be stopped from a thread, and its scratch
memory (4 GB then std::bad_alloc for one 186 KB schema) stays out of the server's process.
Compiled grammars cannot come back (they do not pickle), so it answers only whether the grammar
compiles: ("ok", bytes held, exiting) or ("error", ValueError's message naming the problem, exiting).

Setup: [tokenizer info file (xgrammar's TokenizerInfo.serialize_json), vocab size, RSS limit].
It says ("ready",) once set up, and exits after a compile that leaves it over its RSS limit (the
pool starts a fresh one).
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any


def serve(conn: Any, info_path: str, vocab_size: int, max_rss_bytes: int) -> None:
    import torch
    import xgrammar

    from engine.grammar.compiler import GrammarCompiler

    torch.set_num_threads(1)  # xgrammar's own threads do the work
    with open(info_path) as f:
        info = xgrammar.TokenizerInfo.deserialize_json(f.read())
    compiler = GrammarCompiler(None, vocab_size, cache_bytes=0, info=info)  # checks only: nothing kept
    conn.send(("ready",))
    while True:
        try:
            kind, spec = conn.recv()
        except EOFError:  # the pool is gone
            return
        try:
            reply = ("ok", compiler.compile(kind, spec).memory_size_bytes)
        except ValueError as exc:
            reply = ("error", str(exc))
        exiting = _rss_bytes() > max_rss_bytes  # its heap grew past the limit: a fresh worker replaces it
        conn.send((*reply, exiting))
        if exiting:
            return


def _rss_bytes() -> int:
    """This process's resident memory now. Not getrusage's ru_maxrss: Linux carries it over exec
    from the forked parent, so every worker of a server past the limit looked over it at once
    (and was replaced after each compile)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux: the peak (macOS reports bytes)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


if __name__ == "__main__":  # started by engine/grammar/compile_pool.py: FD SETUP_JSON
    from multiprocessing.connection import Connection

    serve(Connection(int(sys.argv[1])), *json.loads(sys.argv[2]))

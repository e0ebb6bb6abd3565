"""spawn_core: start the engine core's process, from a module light enough to import first.

`tandem serve` spawns the core before its own heavy imports (torch's engine code, transformers,
fastapi): the child's imports, weight load and graph capture then overlap the front end's
imports instead of following them. Nothing here imports torch; the child imports
engine/core/process_main.py itself. ProcessCoreClient (engine/api/process_client.py) adopts a
core spawned here, or spawns its own the same way.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from typing import Any

from engine.config import ServerArgs


@dataclass
class SpawnedCore:
    server_args: ServerArgs
    process: Any  # multiprocessing's SpawnProcess
    conn: Any  # our end of the duplex pipe; the child holds the other

    def kill(self) -> None:
        """For a front end that fails before adopting it: the core must not outlive it."""
        self.conn.close()  # EOF: a core that started stops by itself
        self.process.terminate()
        self.process.join(10)
        if self.process.is_alive():  # stuck in a driver call: a live non-daemon child blocks our exit
            self.process.kill()
            self.process.join(5)


def spawn_core(server_args: ServerArgs) -> SpawnedCore:
    ctx = mp.get_context("spawn")  # safe with CUDA, unlike fork
    conn, child_conn = ctx.Pipe(duplex=True)
    process = ctx.Process(target=_core_main, args=(server_args, child_conn),
                          name="tandem-core", daemon=False)  # daemons may not start compile workers
    process.start()
    child_conn.close()  # only the child holds its end now: its exit reads as EOF here
    return SpawnedCore(server_args, process, conn)


def _core_main(server_args: ServerArgs, conn: Any) -> None:
    from engine.core.startup_clock import mark_entry

    mark_entry()  # before the imports: the ready line tells the spawn from them
    from engine.core.process_main import run_core_process

    run_core_process(server_args, conn)

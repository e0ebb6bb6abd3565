"""TPDriver: rank 0's side of tensor parallelism. It starts ranks 1..N-1 (engine/distributed/
tp_worker.py) in their own processes, joins their TPGroup, and sends them what rank 0 does: the
KV plan once, then every forward pass and every weight update, in rank 0's order; `stop` ends them
(and the processes are reaped, so a shut-down engine leaves none behind).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
from typing import Any

import torch

from engine.config import ServerArgs
from engine.distributed.parallel_state import TPAddress, TPGroup, free_port
from engine.distributed.tp_messages import ForwardStep, KVPlan, LoadWeights, Stop
from engine.models.weight_cast import WeightsPartlyWritten

logger = logging.getLogger("tandem")
STOP_TIMEOUT_S = 30.0


class TPDriver:
    def __init__(self, args: ServerArgs, device: torch.device) -> None:
        from engine.distributed.tp_worker import run_tp_worker

        backend = "nccl" if device.type == "cuda" else "gloo"
        address = TPAddress("127.0.0.1", free_port(), args.tp_size, backend)
        ctx = mp.get_context("spawn")
        self.processes = [ctx.Process(target=run_tp_worker, args=(args, rank, address), name=f"tandem-tp{rank}",
                                      daemon=True) for rank in range(1, args.tp_size)]
        for p in self.processes:
            p.start()
        self._stopped = False
        atexit.register(self.stop)
        try:
            self.group = TPGroup(address, 0)  # the rendezvous: waits for every rank
        except BaseException:
            self._reap(0.0)
            raise

    def send_plan(self, plan: KVPlan) -> None:
        self.group.broadcast_object(plan)

    def send_forward(self, fb: Any, logit_rows: torch.Tensor) -> None:
        """Before rank 0 runs the same pass: the workers enter its collectives with it."""
        self.group.broadcast_object(ForwardStep.of(fb, logit_rows))

    def load_weights(self, source: Any, model: Any, ctx: Any) -> None:
        """Every rank loads its shards of the same update; any rank's failure is raised here.
        A source that every rank would receive separately (a broadcast group) is refused first."""
        if getattr(source, "kind", None) == "distributed":
            raise ValueError("update_weights_from_distributed is not supported with tp_size > 1 yet: the "
                             "engine's other ranks do not join the weight-update group; use "
                             "update_weights_from_tensor or update_weights_from_disk")
        self.group.broadcast_object(LoadWeights(source))
        error = None
        try:
            source.load_into(model, ctx)
        except Exception as exc:  # still collect the workers' answers, to stay in step
            error = exc
        failures = [f for f in self.group.gather_objects(None)[1:] if f is not None]
        if error is not None:
            raise error
        if failures:
            kind, message = failures[0]
            raise WeightsPartlyWritten(f"rank 0 loaded the update but another tensor-parallel rank failed: "
                                       f"{kind}: {message}")

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        if hasattr(self, "group") and all(p.is_alive() for p in self.processes):
            try:
                self.group.broadcast_object(Stop())
            except RuntimeError:  # a worker is gone: the others exit with rank 0's process or are killed
                logger.warning("could not tell the tensor-parallel workers to stop; killing them")
        self._reap(STOP_TIMEOUT_S)

    def _reap(self, timeout: float) -> None:
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(5)

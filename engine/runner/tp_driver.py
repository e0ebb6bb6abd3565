"""TPDriver: rank 0's side of tensor parallelism. It starts ranks 1..N-1
(engine/runner/tp_worker.py) in their own processes, joins their TPGroup, and sends them what
rank 0 does: the KV plan once, then every forward pass and every weight update, in rank 0's order; `stop` ends them
(and the processes are reaped, so a shut-down engine leaves none behind).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing as mp
from typing import Any, Optional

import torch

from engine.config import ServerArgs
from engine.models.parallel_state import TPAddress, TPGroup, free_port
from engine.runner.tp_messages import DiscardWeights, ForwardStep, KVPlan, LoadWeights, Stop
from engine.runner.tp_weight_groups import DestroyWeightsGroup, InitWeightsGroup
from engine.models.weight_cast import WeightsPartlyWritten

logger = logging.getLogger("tandem")
STOP_TIMEOUT_S = 30.0


class TPDriver:
    def __init__(self, args: ServerArgs, device: torch.device) -> None:
        from engine.runner.tp_worker import run_tp_worker

        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and torch.cuda.device_count() < args.tp_size:  # rank t takes GPU t
            visible = torch.cuda.device_count()
            raise ValueError(f"tp_size {args.tp_size} needs {args.tp_size} GPUs; {visible} "
                             f"{'is' if visible == 1 else 'are'} visible")
        address = TPAddress("127.0.0.1", free_port(), args.tp_size, backend)
        ctx = mp.get_context("spawn")
        self.processes = [ctx.Process(target=run_tp_worker, args=(args, rank, address), name=f"tandem-tp{rank}",
                                      daemon=True) for rank in range(1, args.tp_size)]
        for p in self.processes:
            p.start()
        self._stopped = False
        self.abandoned: Optional[str] = None  # why the ranks were stopped out of step (abandon)
        atexit.register(self.stop)
        try:
            # the rendezvous: waits for every rank, naming at once one that exited at start
            self.group = TPGroup(address, 0, check_alive=lambda: self._check_ranks_alive(
                "before joining rank 0 (its error is logged above)"))
        except BaseException:  # the workers wait in the same rendezvous: nothing to tell them
            self._stopped = True
            atexit.unregister(self.stop)
            self._reap(0.0)
            raise

    def send_plan(self, plan: KVPlan) -> None:
        self.group.broadcast_object(plan)

    def send_forward(self, batch: Any, fb: Any, logit_rows: torch.Tensor,
                     table_entries: Optional[torch.Tensor]) -> None:
        """Before rank 0 runs the same pass: the workers enter its collectives with it.
        table_entries: the req_to_token entries their tables need first (ModelRunner._table_entries)."""
        self._check_ranks_alive()  # a waitpid each: cheap, and clearer than gloo's "Connection closed by peer"
        step = ForwardStep.of(batch, fb, logit_rows, table_entries)
        self.group.broadcast_object(step)
        if step.input_ids is None:  # the previous step's samples, still on the device
            self.group.broadcast_tensor(fb.input_ids.contiguous())

    def abandon(self, reason: str) -> None:
        """Rank 0's pass failed after the workers entered it: they wait in its collectives, and the
        next pass's collectives would pair with those (wrong tokens or a hang). Stop them; every
        later pass and update fails at once, naming why."""
        logger.error("stopping the tensor-parallel ranks: %s; this engine cannot run until restarted", reason)
        self.abandoned = reason
        if not self._stopped:
            self._end(told=False)

    def _check_ranks_alive(self, when: str = "; this engine cannot run until restarted") -> None:
        if self.abandoned is not None:
            raise RuntimeError(f"the tensor-parallel ranks were stopped after {self.abandoned}; "
                               f"this engine cannot run until restarted")
        gone = [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.processes) if not p.is_alive()]
        if gone:
            sep = "" if when.startswith(";") else " "
            raise RuntimeError(f"tensor-parallel {', '.join(gone)} exited{sep}{when}")

    def load_weights(self, source: Any, model: Any, ctx: Any) -> None:
        """Every rank loads its shards of the same update; any rank's failure is raised here.
        A source that every rank reads (a checkpoint on disk, a trainer's broadcast) is sent to each
        rank; any other (tensors, a serialized payload) is loaded by rank 0 first, then its full
        tensors go to the other ranks (a refusal on rank 0, checked before any write, sends nothing)."""
        try:
            self._check_ranks_alive()
        except RuntimeError as exc:  # nothing written yet: an update refused before any write
            raise ValueError(str(exc)) from None
        if source.every_rank_reads:
            too_small = self._group_too_small(ctx.groups.get(getattr(source, "group_name", None)))
            if too_small is not None:  # rank 0 alone is in the trainer's group: it receives, drops, refuses
                source.discard(ctx)
                raise ValueError(too_small)
            self.group.broadcast_object(LoadWeights(source=source))
            error = _failure_of(lambda: source.load_into(model, ctx))
        else:
            recorder = _Recorder(model)
            source.load_into(recorder, ctx)
            self.group.broadcast_object(LoadWeights(named_tensors=recorder.named))
            error = None
        failures = [f for f in self.group.gather_objects(None)[1:] if f is not None]
        if error is not None:
            raise error
        if failures:
            kind, message = failures[0]
            raise WeightsPartlyWritten(f"rank 0 loaded the update but another tensor-parallel rank failed: "
                                       f"{kind}: {message}")

    def discard(self, source: Any, ctx: Any) -> None:
        """A refused broadcast update: every rank receives it and drops it (the trainer sends to all)."""
        self.group.broadcast_object(DiscardWeights(source))
        source.discard(ctx)

    def _group_too_small(self, group: Any) -> Any:
        """Why a trainer's group cannot reach every rank (None if it can): rank t is rank_offset + t."""
        if group is None or group.rank + self.group.size <= group.world_size:
            return None
        return (f"weight update group {group.name!r} has world_size {group.world_size}, but this engine's "
                f"{self.group.size} tensor-parallel ranks join it as ranks {group.rank}.."
                f"{group.rank + self.group.size - 1} (rank_offset + t), so only rank 0 receives; destroy it and "
                f"init it with world_size >= {group.rank + self.group.size} (the trainer, then every rank of every "
                f"engine)")

    def init_weights_group(self, msg: Any) -> None:
        """Rank 0 started forming `msg`'s group as rank_offset; rank t joins as rank_offset + t."""
        self._check_ranks_alive()
        if msg.rank_offset + self.group.size > msg.world_size:
            logger.warning("weight update group %r: world_size %d leaves no room for tensor-parallel ranks %d..%d "
                           "(rank_offset + t); its updates will be refused", msg.group_name, msg.world_size,
                           msg.world_size, msg.rank_offset + self.group.size - 1)
        self.group.broadcast_object(InitWeightsGroup(msg.master_address, msg.master_port, msg.rank_offset,
                                                     msg.world_size, msg.group_name, msg.backend, msg.timeout_s))

    def destroy_weights_group(self, name: str) -> None:
        if not self._stopped:  # stopped ranks hold no group
            self.group.broadcast_object(DestroyWeightsGroup(name))

    def stop(self) -> None:
        if self._stopped:
            return
        self._end(told=hasattr(self, "group") and all(p.is_alive() for p in self.processes) and self._tell_stop())

    def _tell_stop(self) -> bool:
        try:
            self.group.cpu.set_timeout(datetime.timedelta(seconds=STOP_TIMEOUT_S))  # bounded, even out of step
            self.group.broadcast_object(Stop())
            return True
        except RuntimeError:
            logger.warning("could not tell the tensor-parallel workers to stop; killing them")
            return False

    def _end(self, told: bool) -> None:
        """A rank not told to stop (one is gone, the Stop failed, the ranks were abandoned) would
        wait forever: killed at once."""
        self._stopped = True
        atexit.unregister(self.stop)
        self._reap(STOP_TIMEOUT_S if told else 0.0)
        if hasattr(self, "group"):
            self.group.close()

    def _reap(self, timeout: float) -> None:
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(5)


class _Recorder:
    """The model as a source sees it on rank 0: loads rank 0's shards and keeps the full tensors
    (host copies of just their own bytes: a view would pickle its whole bucket) for the others."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.named: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights: Any) -> Any:
        weights = list(weights)
        loaded = self.model.load_weights(weights)
        self.named += [(name, t.detach().to("cpu").clone()) for name, t in weights]
        return loaded

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _failure_of(load: Any) -> Any:
    """None, or the exception `load` raised (the other ranks' answers are collected either way)."""
    try:
        load()
    except Exception as exc:
        return exc
    return None

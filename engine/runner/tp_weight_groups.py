"""A tensor-parallel worker's weight-update groups: rank t of an engine joins a trainer's group as
`rank_offset + t` (SGLang's and slime's numbering), so the trainer's one broadcast reaches every
rank and each loads its own shards.

Rank 0 forms its group on the core (engine/core/weight_groups.py) and answers the caller; a worker
forms its own on a thread when rank 0 tells it to, and waits for it at the first update (the
rendezvous needs every rank, so rank 0's group forming means the worker's does too).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("tandem")


@dataclass(frozen=True)
class InitWeightsGroup:
    """Rank 0's init_weights_update_group; tensor-parallel rank t is rank_offset + t in the group."""
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float


@dataclass(frozen=True)
class DestroyWeightsGroup:
    group_name: str


class RankWeightGroups:
    def __init__(self) -> None:
        self._groups: dict[str, Future] = {}
        self._timeouts: dict[str, float] = {}

    def start(self, msg: InitWeightsGroup, tp_rank: int) -> None:
        self.destroy(msg.group_name)  # a re-init replaces a group rank 0 dropped (failed or timed out)
        future: Future = Future()
        self._groups[msg.group_name] = future
        self._timeouts[msg.group_name] = msg.timeout_s
        threading.Thread(target=_form, args=(msg, msg.rank_offset + tp_rank, future),
                         name=f"tandem-tp-rendezvous-{msg.group_name}", daemon=True).start()

    def formed(self, name: str) -> dict[str, Any]:
        """{name: group} once formed (waiting up to its timeout), else {} (the source then says so)."""
        future = self._groups.get(name)
        if future is None:
            return {}
        try:
            return {name: future.result(timeout=self._timeouts[name])}
        except Exception as exc:  # formation failed or timed out: rank 0's answer said so already
            logger.warning("weight update group %r did not form on this rank: %s", name, exc)
            return {}

    def destroy(self, name: str) -> None:
        future = self._groups.pop(name, None)
        self._timeouts.pop(name, None)
        if future is not None:
            future.add_done_callback(_destroy_result)


def _form(msg: InitWeightsGroup, rank: int, future: Future) -> None:
    from weight_sync.weight_group import WeightGroup

    try:
        future.set_result(WeightGroup(msg.master_address, msg.master_port, rank, msg.world_size, msg.group_name,
                                      msg.backend, timeout_s=msg.timeout_s))
    except Exception as exc:
        future.set_exception(exc)


def _destroy_result(future: Future) -> None:
    if future.exception() is None:
        future.result().destroy()

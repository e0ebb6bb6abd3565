"""WeightReads: the messages that read the loaded weights on rank 0 (get_weights_by_name, the
weights checksum, /weights_checker). Refused under TP (one rank holds only its shards) and while
the weights are released."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from engine.core.messages import GetWeightsByNameReq, WeightsCheckerReq, WeightsChecksumReq
from engine.core.weight_checker import WeightChecker
from engine.core.weight_queries import weights_by_name, weights_checksum

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner
    from engine.scheduler.scheduler import Scheduler

WEIGHT_READS = (GetWeightsByNameReq, WeightsChecksumReq, WeightsCheckerReq)


class WeightsOwner(Protocol):
    """What a weight read looks at of the EngineCore (which imports this module, so no import back)."""
    memory_released: set[str]
    scheduler: "Scheduler"
    runner: "ModelRunner"


class WeightReads:
    def __init__(self, core: WeightsOwner) -> None:
        self.core = core
        self.checker = WeightChecker()  # /weights_checker's snapshot lives here

    def handle(self, msg: Any) -> Any:
        runner = self.core.runner
        if runner.tp is not None:
            raise ValueError("get_weights_by_name, the weights checksum and weights_checker read one rank's "
                             "shards under tp_size > 1: not supported yet")
        if "weights" in self.core.memory_released:
            raise ValueError("the weights are released (release_memory_occupation): resume them first")
        if isinstance(msg, GetWeightsByNameReq):
            return weights_by_name(runner.model, msg.name, msg.truncate_size)
        if isinstance(msg, WeightsChecksumReq):
            return weights_checksum(runner.model.named_parameters())
        return self._check_weights(msg)

    def _check_weights(self, msg: WeightsCheckerReq) -> dict:
        scheduler = self.core.scheduler
        resetting = msg.action == "reset_tensors"
        if resetting and scheduler.num_holding_kv():
            raise ValueError("reset_tensors while requests hold KV would finish them on random weights: "
                             "pause generation or let them finish first")
        result = self.checker.run(self.core.runner.model, msg.action, msg.skip_tensor_list, msg.allow_quant_error)
        if resetting:  # cached prefixes were computed with the old weights
            scheduler.flush_cache()
        return result

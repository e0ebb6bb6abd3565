"""LoRAControl: load and unload LoRA adapters between two steps (SGLang's LoRA routes).

A load builds the adapter (every name and shape checked against the model) and registers it
under a fresh id; requests then name it. An unload stops new requests for the adapter at once,
waits (SGLang-like: the front end asks again) until no request uses it, then drops it and its
radix-cache namespace, whose KV no other adapter may read. Replies are SGLang's
{"success", "error_message", "loaded_adapters"}.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional, Protocol

from engine.config import ServerArgs
from engine.core.messages import LoadLoraReq, UnloadLoraReq
from engine.lora.adapter import LoRAAdapter
from engine.lora.lora_config import LoRALimits
from engine.lora.lora_paths import parse_lora_path
from engine.lora.tensor_payload import check_checksums
from engine.lora.registry import LoRARegistry

if TYPE_CHECKING:
    from engine.grammar.compile_queue import GrammarQueue
    from engine.runner.model_runner import ModelRunner
    from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)
LORA_MESSAGES = (LoadLoraReq, UnloadLoraReq)


class LoRACore(Protocol):
    """What LoRA control reads of the EngineCore (which imports this module, so no import back)."""
    scheduler: "Scheduler"
    runner: "ModelRunner"
    grammars: "GrammarQueue"


class LoRAControl:
    def __init__(self, core: LoRACore, args: ServerArgs) -> None:
        self.core = core
        self.enabled = args.enable_lora
        pool = getattr(core.runner, "lora_pool", None)  # the Triton path holds ranks up to its own
        self.limits = LoRALimits.from_flags(pool.max_rank if pool is not None else args.max_lora_rank,
                                            args.lora_target_modules)
        self.registry = LoRARegistry(args.max_loaded_loras)
        self.max_per_batch = args.max_loras_per_batch
        if self.enabled:
            core.runner.lora_adapters = self.registry.by_id
        for spec in map(parse_lora_path, args.lora_paths):  # a bad one fails the start, naming it
            self._add(LoRAAdapter.from_dir(spec.lora_name, spec.lora_path, core.runner.model, self.limits,
                                           spec.pinned))

    def handle(self, msg: Any) -> Optional[dict]:
        if not self.enabled:
            return self._reply(False, "LoRA is not enabled: start the server with --enable-lora (or --lora-paths)")
        try:
            if isinstance(msg, LoadLoraReq):
                self._add(self._build(msg))
                return self._reply(True)
            return self._unload(msg)
        except ValueError as exc:
            return self._reply(False, str(exc))

    def resolve(self, lora_path: Optional[str]) -> Optional[int]:
        """A request's lora_path -> adapter id (None: the base model); ValueError if unknown."""
        if lora_path is None:
            return None
        if not self.enabled:
            raise ValueError("lora_path needs the server started with --enable-lora (or --lora-paths)")
        return self.registry.resolve(lora_path)

    def _build(self, msg: LoadLoraReq) -> LoRAAdapter:
        self.registry.check_can_add(msg.lora_name)
        model = self.core.runner.model
        if msg.source is None:
            if not isinstance(msg.lora_path, str) or not msg.lora_path:
                raise ValueError("load_lora_adapter needs lora_path, the adapter's directory")
            return LoRAAdapter.from_dir(msg.lora_name, msg.lora_path, model, self.limits, msg.pinned)
        source = msg.source.open() if hasattr(msg.source, "open") else msg.source  # the worker opened it already
        pairs = source.pairs()
        if msg.expected_checksums:
            check_checksums(pairs, msg.expected_checksums)
        return LoRAAdapter.from_tensors(msg.lora_name, msg.config_dict, pairs, model, self.limits, pinned=msg.pinned)

    def refusal(self, message: str) -> dict:
        """A load refused before the core saw it (its payload could not be opened in time)."""
        return self._reply(False, message)

    def _add(self, adapter: LoRAAdapter) -> None:
        pinned = len(self.registry.pinned_ids())
        if adapter.pinned and pinned + 1 >= self.max_per_batch:
            raise ValueError(f"{pinned} LoRA adapters are pinned; pinning {adapter.name!r} would leave no pool slot "
                             f"for the others (--max-loras-per-batch {self.max_per_batch}); load it unpinned")
        lora_id = self.registry.add(adapter)
        self._publish_pins()
        logger.info("LoRA adapter %r loaded (id %d, rank %d, %d modules)", adapter.name, lora_id,
                    adapter.config.rank, len(adapter.modules))

    def _unload(self, msg: UnloadLoraReq) -> Optional[dict]:
        if msg.cancel:
            self.registry.cancel_unload(msg.lora_name)
            return self._reply(False, f"LoRA adapter {msg.lora_name!r} is still in use; not unloaded")
        lora_id = self.registry.start_unload(msg.lora_name)
        if self.requests_using(lora_id):
            return None  # asked again until its requests are done
        self.registry.finish_unload(msg.lora_name)
        self._publish_pins()
        freed = self.core.scheduler.tree_cache.drop_namespace(lora_id)
        logger.info("LoRA adapter %r unloaded (%d cached tokens dropped)", msg.lora_name, freed)
        return self._reply(True)

    def _publish_pins(self) -> None:
        """The scheduler keeps a batch's adapters within the pool slots the pinned ones leave."""
        self.core.scheduler.admission.pinned_loras = self.registry.pinned_ids()

    def requests_using(self, lora_id: int) -> int:
        sched, grammars = self.core.scheduler, self.core.grammars
        reqs = list(sched.waiting) + sched.active() + [entry[0] for entry in grammars.waiting]
        return sum(1 for r in reqs if r.lora_id == lora_id)

    def _reply(self, success: bool, error: Optional[str] = None) -> dict:
        """SGLang's LoadLoRAAdapterReqOutput: error_message null on success."""
        return {"success": success, "error_message": error,
                "loaded_adapters": self.registry.loaded_adapters()}

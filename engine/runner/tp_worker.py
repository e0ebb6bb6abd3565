"""TPWorker: tensor-parallel ranks 1..N-1, each in its own process, driven by rank 0 in lockstep.

Rank 0 runs the scheduler and the whole EngineCore; a worker holds its shard of the model, its KV
pool (its own kv heads, rank 0's slot ids) and a copy of the req_to_token entries it is sent. It
loops on rank 0's broadcasts (engine/runner/tp_messages.py): run a forward pass (the
collectives inside pair with rank 0's), load a weight update, or stop. It samples nothing and
decides nothing. It exits when told, when rank 0's process is gone, or on any error (rank 0's next
collective then fails instead of hanging).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from engine.config import ServerArgs, configure_logging
from engine.gc_freeze import freeze_gc
from engine.models.parallel_state import TPAddress, TPGroup, kv_heads_per_rank
from engine.runner.tp_messages import DiscardWeights, ForwardStep, LoadWeights, Stop
from engine.runner.tp_weight_groups import DestroyWeightsGroup, InitWeightsGroup, RankWeightGroups

logger = logging.getLogger("tandem")


class TPWorker:
    def __init__(self, args: ServerArgs, tp: TPGroup, device: torch.device) -> None:
        from transformers import AutoConfig

        from engine.attention.registry import create_attention_backend, default_backend
        from engine.kv.pool import KVPool
        from engine.models.loader import load_model, resolve_dtype

        self.tp, self.device = tp, device
        config = AutoConfig.from_pretrained(args.model_path)
        dtype = resolve_dtype(args.dtype, config, device)
        self.model = load_model(args.model_path, config, dtype, device, args.load_format,
                                deterministic=args.enable_deterministic_inference, tp=tp)
        plan = tp.broadcast_object()
        if isinstance(plan, Stop):  # rank 0 failed to start
            raise SystemExit(0)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_pool = KVPool(plan.max_total_num_tokens, config.num_hidden_layers,
                              kv_heads_per_rank(num_kv_heads, tp.size), head_dim, dtype, device)
        self.req_to_token = torch.zeros((plan.req_rows, plan.context_len + 1), dtype=torch.int64, device=device)
        backend = args.attention_backend or default_backend(device.type)
        self.attn_backend = create_attention_backend(backend, deterministic=args.enable_deterministic_inference)
        self.weight_groups = RankWeightGroups()

    def run(self) -> None:
        while True:
            msg = self.tp.broadcast_object()
            if isinstance(msg, ForwardStep):
                self.forward(msg)
            elif isinstance(msg, LoadWeights):
                self.tp.gather_objects(self.load_weights(msg))
            elif isinstance(msg, DiscardWeights):
                self.discard(msg.source)
            elif isinstance(msg, InitWeightsGroup):
                self.weight_groups.start(msg, self.tp.rank)
            elif isinstance(msg, DestroyWeightsGroup):
                self.weight_groups.destroy(msg.group_name)
            elif isinstance(msg, Stop):
                return
            else:
                raise TypeError(f"TP worker: unknown message {type(msg).__name__}")

    @torch.inference_mode()
    def forward(self, step: ForwardStep) -> None:
        from engine.forward_batch import ForwardBatch

        dev = lambda t: t.to(self.device)  # noqa: E731
        if step.input_ids is None:  # a lookahead step: rank 0's sampled ids follow over the device group
            input_ids = self.tp.broadcast_tensor(torch.empty(len(step.out_cache_loc), dtype=torch.int64,
                                                             device=self.device))
        else:
            input_ids = dev(step.input_ids)
        fb = ForwardBatch(
            forward_mode=step.forward_mode, input_ids=input_ids, positions=dev(step.positions),
            out_cache_loc=dev(step.out_cache_loc), req_pool_indices=dev(step.req_pool_indices),
            seq_lens=dev(step.seq_lens), seq_lens_cpu=step.seq_lens_cpu,
            extend_prefix_lens_cpu=step.extend_prefix_lens_cpu, extend_seq_lens_cpu=step.extend_seq_lens_cpu,
            req_to_token=self.req_to_token, kv_pool=self.kv_pool, attn_backend=self.attn_backend)
        if step.table_entries is not None:
            rows, cols, slots = dev(step.table_entries)
            self.req_to_token[rows, cols] = slots
        if step.forward_mode.is_decode:
            self.req_to_token[fb.req_pool_indices, fb.positions] = fb.out_cache_loc
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        self.model.compute_logits(hidden[dev(step.logit_rows)])  # the LM head's all-gather; rank 0 samples

    def load_weights(self, msg: LoadWeights) -> Any:
        """None, or the failure (type and message) for rank 0 to report."""
        try:
            if msg.named_tensors is not None:
                self.model.load_weights(msg.named_tensors)
            else:
                msg.source.load_into(self.model, self._load_context(msg.source))
            return None
        except Exception as exc:  # reported by rank 0, which answers the update
            logger.exception("TP rank %d: weight update failed", self.tp.rank)
            return type(exc).__name__, str(exc)

    def discard(self, source: Any) -> None:
        """Receive a refused broadcast update and drop it: every rank stays in step with the trainer."""
        try:
            source.discard(self._load_context(source))
        except Exception:  # rank 0 answers the caller; this rank only must not stop
            logger.exception("TP rank %d: discarding a refused update failed", self.tp.rank)

    def _load_context(self, source: Any) -> Any:
        from engine.models.loader import load_safetensors
        from weight_sync.base import LoadContext

        name = getattr(source, "group_name", None)
        return LoadContext(self.device, self.weight_groups.formed(name) if name is not None else {},
                           load_checkpoint=load_safetensors)


def run_tp_worker(args: ServerArgs, rank: int, address: TPAddress) -> None:
    """Entry point of rank `rank`'s process (the 'spawn' context)."""
    logging.basicConfig(format=f"[%(asctime)s tp{rank}] %(message)s")
    configure_logging(args.log_level)
    _exit_with_parent()
    device = torch.device("cpu")
    if address.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    try:
        worker = TPWorker(args, TPGroup(address, rank), device)
        freeze_gc(f"tp rank {rank}")  # as the core does once ready: no full collection walks the model again
        worker.run()
    except SystemExit:
        pass
    except BaseException:
        logger.exception("TP rank %d failed; exiting", rank)
        os._exit(1)  # no teardown: rank 0's next collective sees the closed connection


def _exit_with_parent() -> None:
    """A worker blocked in a broadcast would outlive a killed rank 0: watch the parent instead."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="tandem-tp-parent-watch", daemon=True).start()

"""EngineWeights: Engine's weight and memory verbs (SGLang's names), one seam underneath.

Every update goes through `update_weights(source)`: the SGLang-named methods only build a
weight_sync WeightSource (checked when built, in the caller's thread) and hand it to the core,
which loads it between two steps. Mixed into Engine, which supplies `_call` (one core message,
its answer).
"""

from __future__ import annotations

import time
from typing import Any, Optional, Union

from engine.core.messages import (DestroyWeightsGroupReq, GetWeightsByNameReq, GetWeightVersionReq,
                                  InitWeightsGroupReq, ReleaseMemoryReq, ResumeMemoryReq, SetWeightVersionReq,
                                  UpdateWeightsReq, WeightsCheckerReq, WeightsChecksumReq, WeightsGroupStatusReq,
                                  check_memory_tags)
from engine.api.weight_session import WeightUpdateSession
from engine.weight_version import check_version

GROUP_POLL_S = 0.02  # how often init_weights_update_group asks whether the rendezvous finished


class EngineWeights:
    weight_session: WeightUpdateSession
    model_path: str
    info: Any

    def _call(self, msg: Any) -> Any:
        raise NotImplementedError

    def update_weights(self, source: Any, flush_cache: bool = True, weight_version: Optional[str] = None
                       ) -> tuple[bool, str]:
        """Load one weight_sync WeightSource (tensors, a serialized payload, a checkpoint, a
        broadcast, or any new transport's source) between two steps -> (success, message). Every
        name, shape and dtype is checked before any write: a refused update changes nothing and
        says why. Then the radix cache is flushed (flush_cache) and the version set."""
        from weight_sync.base import WeightSource

        if not isinstance(source, WeightSource):
            raise ValueError(f"update_weights takes a weight_sync WeightSource; got {type(source).__name__}")
        if weight_version is not None:  # any value becomes its text, as the core stores it
            weight_version = check_version(str(weight_version), "weight_version")
        try:
            return self._call(UpdateWeightsReq(source, flush_cache, weight_version))
        except RuntimeError as exc:  # raised while pickling for a core process, before anything was sent
            if "received from another process" not in str(exc):
                raise
            raise ValueError("these CUDA tensors were opened from another process's IPC handles and cannot be "
                             "shared on to the core process: pass the serialized payload to "
                             "update_weights_from_serialized instead") from exc

    def update_weights_from_tensor(self, named_tensors: list, load_format: Optional[str] = None,
                                   flush_cache: bool = True, weight_version: Optional[str] = None
                                   ) -> tuple[bool, str]:
        """named_tensors: [(HF name, tensor)], any subset of the weights; with
        load_format="flattened_bucket", a weight_sync FlattenedBucket or its payload dict; or either
        serialized (weight_sync.cuda_ipc.serialize bytes or text), which the core unpickles.
        -> (success, message); a bad name or shape changes nothing and says which."""
        from weight_sync.tensor import tensor_source

        if load_format == "flattened_bucket" and _per_rank_payloads(named_tensors):
            # sglang.Engine's flattened_bucket form: one serialized bucket per TP rank; rank 0's
            # holds the whole bucket, which tandem's rank 0 loads and sends on
            return self.update_weights_from_serialized(named_tensors[0], load_format, flush_cache, weight_version)
        return self.update_weights(tensor_source(named_tensors, load_format), flush_cache, weight_version)

    def update_weights_from_serialized(self, serialized: Union[bytes, str], load_format: Optional[str] = None,
                                       flush_cache: bool = True, weight_version: Optional[str] = None
                                       ) -> tuple[bool, str]:
        """One `serialized_named_tensors` entry (weight_sync.cuda_ipc.serialize or SGLang's
        MultiprocessingSerializer), unpickled through the allowlist by the core itself: CUDA IPC
        handles are opened in the process that loads them (a core process included)."""
        from weight_sync.tensor import SerializedSource

        return self.update_weights(SerializedSource(serialized, load_format), flush_cache, weight_version)

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                 weight_version: Optional[str] = None, flush_cache: bool = True
                                 ) -> tuple[bool, str, int]:
        """Every weight from a safetensors checkpoint of the same architecture -> (success, message,
        num_paused_requests), the three values sglang.Engine's returns (its tokenizer manager's
        reply; 0 here, as SGLang's scheduler always answers: an update pauses no request)."""
        from weight_sync.disk import DiskSource

        ok, message = self.update_weights(DiskSource(str(model_path), load_format), flush_cache, weight_version)
        if ok:  # get_model_info, and the records after it (tandem replay checks them), name the new one
            self.model_path = str(model_path)
            if getattr(self, "recorder", None) is not None:
                self.recorder.model_path = self.model_path
        return ok, message, 0

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl", timeout_s: float = 30.0) -> tuple[bool, str]:
        """Join the trainer's broadcast group as rank `rank_offset` (the trainer is rank 0 and
        joins at the same time); backend 'gloo' on the CPU. The rendezvous runs off the core
        loop (generation goes on) and fails after `timeout_s` if the trainer never joins."""
        answer = self._call(InitWeightsGroupReq(master_address, int(master_port), int(rank_offset),
                                                int(world_size), group_name, backend, float(timeout_s)))
        while answer is None:  # forming: ask again shortly; each answer comes between two steps
            time.sleep(GROUP_POLL_S)
            answer = self._call(WeightsGroupStatusReq(group_name))
        return answer

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        load_format: Optional[str] = None,
                                        weight_version: Optional[str] = None) -> tuple[bool, str]:
        """Receive one broadcast per name from the group's rank 0 (load_format="flattened_bucket":
        one for all, packed as SGLang's FlattenedTensorBucket), then load them (checked before any
        write) -> (success, message). Positionally in sglang.Engine's order (load_format sixth)."""
        from weight_sync.nccl import GroupSource

        source = GroupSource(list(names), list(dtypes), [list(s) for s in shapes], group_name, load_format)
        return self.update_weights(source, flush_cache, weight_version)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        return self._call(DestroyWeightsGroupReq(group_name))

    def get_weight_version(self) -> str:
        return self._call(GetWeightVersionReq())

    def begin_weight_update(self, selector: str = "all") -> tuple[bool, str]:
        """SGLang 0.5.23's session around a sync (Miles: begin, the updates, end): checks the pairing
        only, since tandem loads each update as it comes (engine/api/weight_session.py)."""
        return self.weight_session.begin(selector)

    def end_weight_update(self) -> tuple[bool, str]:
        return self.weight_session.end()

    def get_model_info(self) -> dict:
        """SGLang 0.5.23's Engine.get_model_info (its /model_info's keys): the checkpoint served now."""
        return {"model_path": self.model_path, "tokenizer_path": self.info.tokenizer_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.get_weight_version(),
                "has_image_understanding": False, "has_audio_understanding": False}

    def update_weight_version(self, new_version: str) -> str:
        return self._call(SetWeightVersionReq(check_version(str(new_version), "new_version")))

    # ---- colocated memory ----------------------------------------------------------------------
    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> tuple[bool, str]:
        """Free the GPU memory of `tags` (weights, kv_cache, cuda_graph; None = all) for a
        colocated trainer. Generation waits until everything is resumed."""
        return self._call(ReleaseMemoryReq(check_memory_tags(tags)))

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> tuple[bool, str]:
        """Bring `tags` back (weights first and KV last lets a weight update land between)."""
        return self._call(ResumeMemoryReq(check_memory_tags(tags)))

    # ---- weight queries ------------------------------------------------------------------------
    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of the parameter an HF checkpoint name loads into."""
        return self._call(GetWeightsByNameReq(str(name), truncate_size))

    def get_weights_checksum(self) -> str:
        """sha256 hex over every parameter (SGLang's compute_weights_checksum): equal for equal
        weights on any engine; engine.core.weight_queries.weights_checksum hashes a trainer's."""
        return self._call(WeightsChecksumReq())

    def check_weights(self, action: str = "checksum", skip_tensor_list: Optional[list[str]] = None,
                      allow_quant_error: bool = False) -> dict:
        """SGLang's weights checker (Miles' --check-weight-update-equal): "snapshot", then
        "reset_tensors", then after a sync "compare" (success only if every tensor was rewritten to
        its snapshot); "checksum" hashes each tensor. {"success", "message"[, "checksums"]}."""
        return self._call(WeightsCheckerReq(str(action), tuple(skip_tensor_list or ()), bool(allow_quant_error)))


def _per_rank_payloads(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, (bytes, str)) for v in value)

"""Recorder: with --record-path, one JSON line per finished request, for `tandem replay`.

A line holds what replaying needs (prompt ids, sampling params, the seed the request actually
used, logprob settings, model and weight version) and what it is checked against (output ids,
output logprob values, finish reason). Floats are written with repr, so they read back bit for
bit. Each line is flushed as it is written; a failing write is logged and never fails a request.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from engine.core.engine_core import EngineCore
    from engine.scheduler.request import Req

logger = logging.getLogger("tandem")

REQUIRED_FIELDS = (
    "rid", "model_path", "weight_version", "input_ids", "sampling_params", "sampling_seed",
    "return_logprob", "logprob_start_len", "output_ids", "output_token_logprobs", "finish_reason",
)


def record_of(req: "Req", model_path: str, weight_version: str) -> dict[str, Any]:
    return {
        "rid": req.rid,
        "model_path": model_path,
        "weight_version": weight_version,
        "input_ids": list(req.origin_input_ids),
        "sampling_params": req.sampling_params.to_dict(),
        "sampling_seed": req.seed,
        "return_logprob": req.return_logprob,
        "logprob_start_len": req.logprob_start_len,
        "top_logprobs_num": req.top_logprobs_num,
        "logprob_distribution": req.logprob_distribution,
        "output_ids": list(req.output_ids),
        "output_token_logprobs": list(req.output_logprobs) if req.return_logprob else None,
        "finish_reason": req.finished_reason,
    }


class Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8")
        self._failed = False

    @classmethod
    def maybe_open(cls, path: Optional[str]) -> Optional["Recorder"]:
        return cls(path) if path else None

    def record(self, req: "Req", core: "EngineCore") -> None:
        try:
            line = json.dumps(record_of(req, core.server_args.model_path, core.weight_version), default=str)
            self._file.write(line + "\n")
            self._file.flush()
        except Exception as exc:  # disk full, file closed, odd values: keep serving
            if not self._failed:
                logger.error("recording request %s to %s failed: %s", req.rid, self.path, exc)
            self._failed = True

    def close(self) -> None:
        self._file.close()

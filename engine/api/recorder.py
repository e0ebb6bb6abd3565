"""Recorder: with --record-path, one JSON line per finished request, for `tandem replay`.

A line holds what replaying needs (prompt ids, sampling params, the seed the request actually
used, logprob settings, model and weight version) and what it is checked against (output ids,
output logprob values, finish reason). Floats are written with repr, so they read back bit for
bit. Each line is flushed as it is written; a failing write is logged and never fails a request.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

from engine.core.messages import ReqInput

logger = logging.getLogger("tandem")

REQUIRED_FIELDS = (
    "rid", "model_path", "weight_version", "input_ids", "sampling_params", "sampling_seed",
    "return_logprob", "logprob_start_len", "output_ids", "output_token_logprobs", "finish_reason",
)


def record_of(req: ReqInput, output: dict[str, Any], model_path: str) -> dict[str, Any]:
    meta = output["meta_info"]
    logprobs = meta.get("output_token_logprobs")
    return {
        "rid": req.rid,
        "model_path": model_path,
        "weight_version": meta.get("weight_version"),
        "input_ids": list(req.input_ids),
        "sampling_params": req.sampling_params.to_dict(),
        "sampling_seed": req.seed,
        "return_logprob": req.return_logprob,
        "logprob_start_len": req.logprob_start_len,  # these three: normalised by the RequestBuilder
        "top_logprobs_num": req.top_logprobs_num,
        "token_ids_logprob": req.token_ids_logprob,
        "logprob_distribution": req.logprob_distribution,
        "output_ids": list(output["output_ids"]),
        "output_token_logprobs": [entry[0] for entry in logprobs] if req.return_logprob and logprobs else
                                 ([] if req.return_logprob else None),
        "finish_reason": meta.get("finish_reason"),
    }


class Recorder:
    """An output sink the Engine installs: one line per finished request."""

    def __init__(self, path: str, model_path: str) -> None:
        self.path = path
        self.model_path = model_path
        self._file = open(path, "a", encoding="utf-8")
        self._failed = False

    @classmethod
    def maybe_open(cls, path: Optional[str], model_path: str) -> Optional["Recorder"]:
        return cls(path, model_path) if path else None

    def record(self, req: ReqInput, output: dict[str, Any]) -> None:
        try:
            line = json.dumps(record_of(req, output, self.model_path), default=str)
            self._file.write(line + "\n")
            self._file.flush()
        except Exception as exc:  # disk full, file closed, odd values: keep serving
            if not self._failed:
                logger.error("recording request %s to %s failed: %s", req.rid, self.path, exc)
            self._failed = True

    def close(self) -> None:
        self._file.close()

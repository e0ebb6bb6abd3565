"""Sample: one generated response with everything a trainer needs from the rollout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

STATUSES = ("completed", "truncated", "aborted")


@dataclass
class Sample:
    group: int  # which prompt of the batch
    index: int  # which of that prompt's n samples
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # one per response token, as the engine computed them
    weight_versions: list[str]  # one per response token: the weights that produced it
    status: str  # completed (a stop token or string), truncated (max_new_tokens), aborted
    text: str = ""
    label: Any = None  # what the reward function checks the response against
    reward: Optional[float] = None
    metadata: dict = field(default_factory=dict)
    # MoE (return_routed_experts): the engine's base64 int32 [prompt + response - 1, layers, top_k],
    # for a trainer that replays the rollout's routes (R3)
    routed_experts: Optional[str] = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Sample status must be one of {', '.join(STATUSES)}; got {self.status!r}")

    @property
    def loss_mask(self) -> list[int]:
        """1 for tokens the policy produced (all of a single-turn response)."""
        return [1] * len(self.response_ids)

    @classmethod
    def from_output(cls, out: dict, group: int, index: int, prompt_ids: list[int], label: Any = None) -> "Sample":
        """From an engine output dict (return_logprob=True)."""
        meta = out["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type")
        status = {"length": "truncated", "abort": "aborted"}.get(reason, "completed")
        logprobs = [entry[0] for entry in meta.get("output_token_logprobs", [])]
        versions: list[str] = []
        for span in meta.get("weight_versions", []):
            versions += [span["version"]] * (span["end"] - span["start"])
        return cls(group, index, list(prompt_ids), list(out["output_ids"]), logprobs, versions, status,
                   text=out.get("text", ""), label=label, routed_experts=meta.get("routed_experts"),
                   metadata={"finish_reason": meta.get("finish_reason"), "cached_tokens": meta.get("cached_tokens")})

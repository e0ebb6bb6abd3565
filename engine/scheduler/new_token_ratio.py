"""NewTokenRatio: SGLang's forecast of how much of its max_new_tokens a running request will use.

Admission reserves remaining max_new_tokens x ratio for every running request. The ratio starts
at 0.7 (scaled by --schedule-conservativeness), decays each decode step to a floor while nothing
goes wrong, and jumps back up when decode runs out of KV slots and requests are retracted.
"""

from __future__ import annotations

from typing import Sequence

from engine.scheduler.request import Req

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20  # tokens each surviving request is assumed to still need


class NewTokenRatio:
    def __init__(self, conservativeness: float = 1.0) -> None:
        self.init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.floor = self.init * MIN_NEW_TOKEN_RATIO_FACTOR
        self.step = (self.init - self.floor) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init

    def decay(self) -> None:
        self.value = max(self.value - self.step, self.floor)

    def after_retraction(self, running: Sequence[Req]) -> float:
        """Resets the ratio from what the survivors have decoded; returns the old value."""
        old = self.value
        decoded = sum(len(r.output_ids) for r in running)
        budget = sum(r.sampling_params.max_new_tokens for r in running) or 1
        self.value = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / budget)
        return old

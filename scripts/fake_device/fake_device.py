"""A fake device for measuring the host's share of serving on a machine without a GPU.

The model pass is replaced by zero logits that are "ready" only after a modelled device time:
a pass is queued behind the previous one (a GPU runs passes in order while the host goes on)
and `PendingResult.resolve` sleeps until its pass is due, releasing the GIL as a wait on a CUDA
event does. So the host's scheduling, intake, IPC and replies run for real, against a device
whose step times are those given. Spec: "decode_ms_base,decode_ms_per_row,prefill_us_per_token"
(defaults model Qwen3-0.6B on one H200: 1.2 ms + 0.024 ms a row a decode step, 4 us a prompt
token). Overlap scheduling is on, as on CUDA. With the tiny model:

    export PYTHONPATH=scripts/fake_device TANDEM_FAKE_DEVICE=1
    python -m tandem.main bench --skip-tokenizer-init --preset tiny --num-prompts 64 --input-len 512 --output-len 256 --stream-mode final --runs 3
    python -m tandem.main serve --model-path /tmp/tiny --skip-tokenizer-init --core-process &  # then bench --url

On a 2-core CPU (2026-12-05): HTTP with the core process at 0.985x of in-process at 64
concurrent, both at b378430 and after, where the H200 measured 0.891x: what HTTP loses there
is not the host work modelled here."""

from __future__ import annotations

import threading
import time

_state = threading.local()


def install(spec: str) -> None:
    import torch

    from engine.core.engine_core import EngineCore
    from engine.runner.model_runner import ModelRunner
    from engine.runner.pending_result import PendingResult

    base_ms, row_ms, token_us = (float(x) for x in (spec.split(",") if spec not in ("1", "") else (1.2, 0.024, 4.0)))
    device_free = [0.0]  # when the fake device finishes what it was given

    def fake_logits(self, fb, plan):
        prompt_tokens = sum(n for n in fb.extend_seq_lens_cpu if n > 1)  # a decode row extends by 1
        seconds = (base_ms + row_ms * fb.batch_size) / 1e3 + prompt_tokens * token_us / 1e6
        device_free[0] = max(time.perf_counter(), device_free[0]) + seconds
        _state.due = device_free[0]
        return torch.zeros(len(plan.rows), self.config.vocab_size, device=self.device)

    start, resolve = PendingResult.start.__func__, PendingResult.resolve

    def fake_start(cls, batch, next_ids, logprobs):
        pending = start(cls, batch, next_ids, logprobs)
        pending.fake_due = getattr(_state, "due", 0.0)
        return pending

    def fake_resolve(self):
        wait = getattr(self, "fake_due", 0.0) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return resolve(self)

    init = EngineCore.__init__

    def overlapping_init(self, server_args, *args, **kwargs):
        init(self, server_args, *args, **kwargs)
        self.overlap = not server_args.disable_overlap_schedule  # as on CUDA (the CPU turns it off)

    EngineCore.__init__ = overlapping_init
    ModelRunner._logits = fake_logits
    PendingResult.start = classmethod(fake_start)
    PendingResult.resolve = fake_resolve

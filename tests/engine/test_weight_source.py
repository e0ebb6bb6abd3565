"""The one weight seam: Engine.update_weights(source) loads any weight_sync WeightSource.

A new transport that reuses it is one module: here the module is this file, whose source reads
each safetensors file of a checkpoint lazily, one file at a time, and hands the pairs to the model.
Oracle: an engine started on that checkpoint. The SGLang-named methods are shims over the same call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.engine.conftest import random_prompts
from weight_sync.base import LoadContext, WeightSource

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@dataclass
class FileByFileSource(WeightSource):
    """A transport that is not in weight_sync/: every safetensors file of `model_dir`, read in the core."""
    model_dir: str

    def load_into(self, model: Any, ctx: LoadContext) -> None:
        from safetensors.torch import load_file

        from engine.models.loader import safetensors_files

        model.load_weights([pair for path in safetensors_files(self.model_dir) for pair in load_file(path).items()])


def _ids(eng, prompts) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]


def test_a_source_defined_outside_weight_sync_loads_through_update_weights(engine_factory, other_model_dir,
                                                                           other_engine, tiny_model_dir):
    eng = engine_factory()
    prompts = random_prompts(3, eng.local_core.parts.vocab_size, lengths=(5, 40), seed=11)
    before = _ids(eng, prompts)
    ok, message = eng.update_weights(FileByFileSource(other_model_dir), weight_version="new-transport")
    assert ok and message == "Success. Weight version updated to new-transport.", message
    after = _ids(eng, prompts)
    assert after == _ids(other_engine, prompts) and after != before
    assert eng.get_weight_version() == "new-transport"
    ok, message = eng.update_weights(FileByFileSource(str(tiny_model_dir)), flush_cache=True)
    assert ok, message
    assert _ids(eng, prompts) == before
    eng.check_integrity()


def test_update_weights_takes_only_a_source(engine_factory, other_model_dir):
    eng = engine_factory()
    with pytest.raises(ValueError, match="takes a weight_sync WeightSource; got str"):
        eng.update_weights(other_model_dir)
    assert eng.get_weight_version() == "default"


def test_update_from_tensor_takes_a_serialized_payload_and_the_core_opens_it(engine_factory, other_model_dir,
                                                                             other_engine):
    """What the Ray engine actor passes on as it is (a trainer's cuda_ipc payload)."""
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files
    from weight_sync.bucket import FlattenedBucket
    from weight_sync.cuda_ipc import serialize

    eng = engine_factory()
    prompts = random_prompts(2, eng.local_core.parts.vocab_size, lengths=(5, 40), seed=12)
    named = [pair for path in safetensors_files(other_model_dir) for pair in load_file(path).items()]
    payload = serialize(FlattenedBucket.pack(named).to_payload())
    ok, message = eng.update_weights_from_tensor(payload, load_format="flattened_bucket", weight_version="ipc")
    assert ok, message
    assert _ids(eng, prompts) == _ids(other_engine, prompts)
    ok, message = eng.update_weights_from_tensor(b"not a pickle")
    assert not ok and message.startswith("Weights not updated: payload refused") and "could not be read" in message
    with pytest.raises(ValueError, match="load_format 'bogus'"):
        eng.update_weights_from_tensor(payload, load_format="bogus")
    assert eng.get_weight_version() == "ipc"

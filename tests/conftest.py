"""Suite-wide pytest hooks: `gpu`-marked tests are skipped on machines without CUDA; Triton's
interpreter computes tl.dot row by row on every CPU (engine/testing/triton_for_tests.py)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="session")
def _row_invariant_interpreter_dot() -> None:
    from engine.testing.triton_for_tests import row_invariant_interpreter_dot

    row_invariant_interpreter_dot()  # after collection: the Triton test modules set TRITON_INTERPRET

"""Sample.status is one of rollout.types.STATUSES, from the engine's finish reason."""

import pytest

from rollout.types import STATUSES, Sample


@pytest.mark.parametrize("reason, status", [({"type": "stop"}, "completed"), ({"type": "length"}, "truncated"),
                                            ({"type": "abort"}, "aborted"), (None, "completed")])
def test_status_from_the_finish_reason(reason, status):
    out = {"output_ids": [5], "meta_info": {"finish_reason": reason}}
    assert Sample.from_output(out, 0, 0, [1]).status == status and status in STATUSES


def test_an_unknown_status_is_refused():
    with pytest.raises(ValueError, match="status must be one of completed, truncated, aborted; got 'done'"):
        Sample(0, 0, [1], [2], [-0.1], ["v"], "done")

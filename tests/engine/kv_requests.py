"""Request stand-ins for the KV tests: admission and compute steps as the scheduler does them."""

from __future__ import annotations

from types import SimpleNamespace


def new_req(tree, pool, prompt):
    """What the scheduler does on admission: capped match, lock, row, prefix into the row."""
    m = tree.match_prefix(prompt[:-1])
    tree.inc_lock_ref(m.last_node)
    idx = pool.alloc()
    pool.write(idx, 0, m.indices)
    n = len(m.indices)
    return SimpleNamespace(
        req_pool_idx=idx, origin_input_ids=list(prompt), output_ids=[], fill_ids=list(prompt[:n]),
        prefix_indices=m.indices, last_node=m.last_node, kv_committed_len=n,
    )


def compute(alloc, pool, req, k, slots=None):
    """Run k more positions (prefill chunk or decode step); sample a token when caught up."""
    seq = req.origin_input_ids + req.output_ids
    slots = alloc.alloc(k) if slots is None else slots
    pool.write(req.req_pool_idx, req.kv_committed_len, slots)
    req.kv_committed_len += k
    req.fill_ids = seq[: req.kv_committed_len]
    if req.kv_committed_len == len(seq):
        req.output_ids.append(100 + len(req.output_ids))
    return slots

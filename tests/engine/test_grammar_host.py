"""The grammar's host side (engine/grammar): the packed mask unpacked as xgrammar applies it,
reused ring buffers giving fresh masks, and matchers advanced a batch at a time.

Oracles: xgrammar's own apply_token_bitmask_inplace, a freshly allocated bitmask, and
GrammarMatcher.accept_token / is_terminated one row at a time.
"""

from __future__ import annotations

import json

import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")

from engine.sampling.token_mask import masked_logits, unpack_forbidden  # noqa: E402
from tests.engine.test_grammar import SCHEMA  # noqa: E402


def test_unpacked_mask_matches_xgrammar_apply():
    """The [B, V] mask equals what xgrammar's own apply_token_bitmask_inplace does."""
    vocab = 70  # not a multiple of 32
    bitmask = xgrammar.allocate_token_bitmask(3, vocab)
    gen = torch.Generator().manual_seed(0)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int32))
    logits = torch.randn(3, vocab, generator=gen)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask)
    ours = logits.masked_fill(unpack_forbidden(bitmask, vocab), float("-inf"))
    assert torch.equal(ours, expected)
    assert torch.equal(masked_logits(logits, bitmask), expected)  # what the sampler applies


def test_a_failing_mask_kernel_falls_back_to_torch_for_good(monkeypatch, caplog):
    """The Triton pass compiles at its first call; where it cannot, that call and every later one
    are served by the torch path (one warning), never a failed step."""
    import engine.sampling.token_mask as token_mask

    calls = []

    class Broken:
        @staticmethod
        def masked_logits(logits, bitmask):
            calls.append(1)
            raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(token_mask, "_FAILED", [])
    monkeypatch.setattr(token_mask, "_kernel", lambda: Broken)
    monkeypatch.setattr(token_mask, "_on_gpu", lambda logits: True)
    bitmask = torch.tensor([[0b1010]], dtype=torch.int32)
    logits = torch.arange(4, dtype=torch.float32).unsqueeze(0)
    for _ in range(3):
        out = token_mask.masked_logits(logits, bitmask)
        assert torch.equal(out, torch.tensor([[float("-inf"), 1.0, float("-inf"), 3.0]]))
    assert calls == [1] and "masking with torch ops instead" in caplog.text


def _walked_grammars(engine, n: int, seed: int = 0) -> list:
    """n RequestGrammars over SCHEMA, each advanced by a random number of allowed tokens."""
    from engine.grammar import BitmaskRing, GrammarCompiler, RequestGrammar, fill_bitmask

    vocab = engine.local_core.parts.vocab_size
    compiler = GrammarCompiler(engine.tokenizer, vocab, (0, 2))
    compiled = compiler.compile("json_schema", json.dumps(SCHEMA))
    gen = torch.Generator().manual_seed(seed)
    ring = BitmaskRing(vocab, "cpu")
    grammars = []
    for i in range(n):
        grammar = RequestGrammar(compiled)
        for _ in range(int(torch.randint(0, 12, (1,), generator=gen))):
            allowed = (~unpack_forbidden(ring.to_device(fill_bitmask([grammar], ring)), vocab)[0]).nonzero().flatten()
            if grammar.is_terminated() or len(allowed) == 0:
                break
            assert grammar.accept(int(allowed[torch.randint(len(allowed), (1,), generator=gen)]))
        grammars.append(grammar)
    return grammars


def test_reused_bitmask_buffers_give_fresh_masks(engine):
    """The ring's buffers come back holding an older step's bits; every row of the next mask is
    still exactly what a freshly allocated bitmask gets (rows without a grammar allow all)."""
    from engine.grammar import BitmaskRing, fill_bitmask

    vocab = engine.local_core.parts.vocab_size
    grammars = _walked_grammars(engine, 6) + [None]
    ring = BitmaskRing(vocab, "cpu", depth=2)
    for _ in range(2):  # garbage in both buffers
        ring.take(len(grammars)).copy_(torch.randint(-(2**31), 2**31 - 1, (len(grammars), ring.words), dtype=torch.int32))
    fresh = xgrammar.allocate_token_bitmask(len(grammars), vocab)
    live = [i for i, g in enumerate(grammars) if g is not None and not g.is_terminated()]
    xgrammar.BatchGrammarMatcher().batch_fill_next_token_bitmask([grammars[i].matcher for i in live], fresh, live)
    for order in ([grammars], [grammars[::-1]]):  # twice round the ring, with None rows moved
        rows = order[0]
        got = fill_bitmask(rows, ring)
        want = fresh if rows is grammars else fresh.flip(0)
        assert torch.equal(got, want)
        assert torch.equal(ring.to_device(got), want)


def test_batched_accept_and_termination_match_the_matcher(engine):
    """accept_tokens (one call for the batch) moves every matcher as accept_token would, refuses
    a forbidden token without moving its matcher, and is_terminated (tracked on stop tokens)
    agrees with xgrammar's own at every step."""
    from engine.grammar import BitmaskRing, GrammarCompiler, RequestGrammar, fill_bitmask
    from engine.grammar.matcher import accept_tokens

    vocab, stop = engine.local_core.parts.vocab_size, 2
    compiled = GrammarCompiler(engine.tokenizer, vocab, (stop,)).compile("json_schema", json.dumps(SCHEMA))
    docs = ['{"color": "red", "size": 3, "tags": {"ok": true}}', '{"color": "blue", "size": -12, "tags": {"ok": false}}',
            '{"color": "green", "size": 7, "tags": {"ok": true}}']
    streams = [engine.tokenizer.encode(d, add_special_tokens=False) + [stop] for d in docs]
    grammars = [RequestGrammar(compiled) for _ in docs]
    twins = [xgrammar.GrammarMatcher(compiled) for _ in docs]
    ring, refused = BitmaskRing(vocab, "cpu"), 0
    for step in range(max(len(t) for t in streams)):
        rows = [i for i, t in enumerate(streams) if step < len(t)]
        tokens = [streams[i][step] for i in rows]
        if step == 3:  # row 1 samples a token its grammar forbids
            forbidden = unpack_forbidden(ring.to_device(fill_bitmask([grammars[1]], ring)), vocab)[0]
            tokens[1] = int(forbidden.nonzero().flatten()[0])
        got = accept_tokens([grammars[i] for i in rows], tokens)
        want = [twins[i].accept_token(t) for i, t in zip(rows, tokens)]
        assert got == want, step
        refused += want.count(False)
        if step == 3:  # the refused token left the matcher where it was: feed the real one
            assert accept_tokens([grammars[1]], [streams[1][3]]) == [twins[1].accept_token(streams[1][3])] == [True]
        assert [g.is_terminated() for g in grammars] == [m.is_terminated() for m in twins], step
    assert refused == 1 and all(g.is_terminated() for g in grammars)
    assert grammars[0].num_accepted == len(streams[0])

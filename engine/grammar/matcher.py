"""RequestGrammar: one request's xgrammar matcher, advanced only on committed output tokens.

The scheduler holds it as an opaque field of Req (it never imports xgrammar). Because it moves
only on committed tokens, a retracted request, which keeps its output_ids, resumes with a
matcher that is still exact.

A decode step advances every constrained row of the batch in one call into xgrammar
(accept_tokens), and a matcher ends only by accepting one of its stop tokens, so termination is
asked of xgrammar only then: at 64 rows a step, a call per row per question was ~0.3 ms of the
core's host time on the H200's host.
"""

from __future__ import annotations

from typing import Any, Sequence


class RequestGrammar:
    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)  # engine.grammar.vocab_mask fills masks from it
        self._stop_ids = frozenset(compiled.tokenizer_info.stop_token_ids)
        self._terminated = False
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance on a committed token; False when the grammar refuses it (the matcher is unchanged)."""
        return accept_tokens([self], [token_id])[0]

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self._terminated


def accept_tokens(grammars: Sequence[RequestGrammar], token_ids: Sequence[int]) -> list[bool]:
    """Advance each grammar on its committed token, in one call into xgrammar; False where a
    grammar refuses its token (that matcher is unchanged)."""
    import xgrammar

    tokens = [int(t) for t in token_ids]
    accepted = xgrammar.BatchGrammarMatcher.batch_accept_token([g.matcher for g in grammars], tokens)
    for grammar, token, ok in zip(grammars, tokens, accepted):
        if ok:
            grammar.num_accepted += 1
            if token in grammar._stop_ids:  # inline: this loop runs for every constrained row, every step
                grammar._terminated = grammar.matcher.is_terminated()
    return accepted

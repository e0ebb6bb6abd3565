"""RequestGrammar: one request's xgrammar matcher, advanced only on committed output tokens.

The scheduler holds it as an opaque field of Req (it never imports xgrammar). Because it moves
only on committed tokens, a retracted request, which keeps its output_ids, resumes with a
matcher that is still exact.
"""

from __future__ import annotations

from typing import Any


class RequestGrammar:
    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)  # engine.grammar.vocab_mask fills masks from it
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance on a committed token; False when the grammar refuses it (the matcher is unchanged)."""
        ok = self.matcher.accept_token(int(token_id))
        self.num_accepted += ok
        return ok

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self.matcher.is_terminated()


"""Structured output: xgrammar grammars compiled per (kind, spec), one matcher per request.

xgrammar is imported only inside these modules' functions, so importing the package is free
and an engine without xgrammar serves every request that carries no grammar.
"""

from engine.grammar.compiler import GRAMMAR_KINDS, GrammarCompiler, grammar_spec
from engine.grammar.matcher import RequestGrammar
from engine.grammar.bitmask_ring import BitmaskRing
from engine.grammar.vocab_mask import fill_bitmask

__all__ = ["GRAMMAR_KINDS", "BitmaskRing", "GrammarCompiler", "RequestGrammar", "fill_bitmask", "grammar_spec"]

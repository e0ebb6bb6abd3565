"""GrammarCompiler: json_schema / regex / ebnf / structural_tag -> xgrammar CompiledGrammar.

One compiler per tokenizer; compiled grammars are cached per (kind, spec) string, so a grammar
that every request of a rollout carries is compiled once. The cache is bounded by bytes (xgrammar's
memory_size_bytes of each, least recently used out first), not by count: one compiled schema can
hold 100 MB. Compiled grammars do not pickle (and serialize_json of a 15 MB one ran out of memory),
so the front end validates in a killable child process (engine.grammar.compile_pool) and the core
compiles again from the spec, through its own cache, on worker threads (engine.grammar.compile_queue).
"""

from __future__ import annotations

import ctypes
import json
import re
import threading
from collections import OrderedDict
from typing import Any, Optional, Sequence

from engine.sampling_params import GRAMMAR_FIELDS

GRAMMAR_KINDS = GRAMMAR_FIELDS  # the sampling params that carry a grammar
DEFAULT_CACHE_BYTES = 256 << 20
_LOG_PREFIX = re.compile(r"\[\d{2}:\d{2}:\d{2}\] [^\s:]+:\d+: ")  # xgrammar's C++ log lines
RSS_PER_COUNTED_BYTE = 1.5  # RSS a kept grammar costs per byte of its memory_size_bytes (measured: 1.33-1.45)


def grammar_spec(params: Any) -> Optional[tuple[str, str]]:
    """(kind, spec) of the one grammar field set on a SamplingParams, or None."""
    for kind in GRAMMAR_KINDS:
        spec = getattr(params, kind, None)
        if spec is not None:
            return kind, spec
    return None


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()) -> Any:
    """xgrammar's TokenizerInfo of a HF tokenizer (indexing the vocabulary: ~0.5 s for Qwen's)."""
    xgrammar = _import_xgrammar()
    if tokenizer is None:
        raise ValueError("structured output needs the tokenizer; this engine was started with "
                         "skip_tokenizer_init")
    return xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = (),
                 cache_bytes: int = DEFAULT_CACHE_BYTES, info: Any = None) -> None:
        xgrammar = _import_xgrammar()
        info = info if info is not None else tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.info = info
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # cached here, by spec
        self._cache: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()  # oldest use first
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0
        self._lock = threading.Lock()

    def cached(self, kind: str, spec: str) -> Optional[Any]:
        """The CompiledGrammar if (kind, spec) was compiled already, else None (never compiles)."""
        with self._lock:  # the core's loop reads while compile threads add
            entry = self._cache.get((kind, spec))
            if entry is None:
                return None
            self._cache.move_to_end((kind, spec))
            return entry[0]

    def compile(self, kind: str, spec: str) -> Any:
        """The CompiledGrammar for (kind, spec); ValueError naming the field and xgrammar's reason."""
        compiled = self.cached(kind, spec)
        if compiled is None:
            try:
                compiled = self._compile(kind, spec)
            except ValueError:
                raise
            except Exception as exc:  # xgrammar raises RuntimeError and its own types on bad input
                raise ValueError(f"invalid {kind} grammar: {_reason(exc)}") from None
            finally:
                release_freed_memory()  # a compile's scratch is several times what it keeps
            self._keep((kind, spec), compiled)
        return compiled

    def _keep(self, key: tuple[str, str], compiled: Any) -> None:
        size = compiled_size(compiled, key[1])
        with self._lock:
            if size > self.cache_bytes or key in self._cache:
                return  # compiled concurrently by another thread, or too large to keep: used, not cached
            while self._cache and self.cached_bytes + size > self.cache_bytes:
                _, (_, dropped) = self._cache.popitem(last=False)
                self.cached_bytes -= dropped
            self._cache[key] = (compiled, size)
            self.cached_bytes += size

    def _compile(self, kind: str, spec: str) -> Any:
        c = self._compiler
        if kind == "json_schema":
            _check_json(kind, spec)
            return c.compile_grammar(_json_schema_grammar(spec))
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "ebnf":
            return c.compile_grammar(spec)
        if kind == "structural_tag":
            return self._compile_structural_tag(spec)
        raise ValueError(f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")

    def _compile_structural_tag(self, spec: str) -> Any:
        """xgrammar's format ({"type": "structural_tag", "format": ...}) or SGLang's older one
        ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}), which SGLang clients send."""
        value = _check_json("structural_tag", spec)
        if not isinstance(value, dict) or "structures" not in value:
            return self._compiler.compile_structural_tag(spec)
        import xgrammar

        structures, triggers = value["structures"], value.get("triggers", [])
        if not isinstance(structures, list) or not all(
                isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                and "schema" in s for s in structures):
            raise ValueError('structural_tag: "structures" must be a list of {"begin": str, "schema": JSON schema, '
                             '"end": str}')
        if not isinstance(triggers, list) or not all(isinstance(t, str) for t in triggers):
            raise ValueError('structural_tag: "triggers" must be a list of strings')
        tags = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                for s in structures]
        return self._compiler.compile_structural_tag(tags, triggers)


# xgrammar's character of a string with minLength/maxLength admits control characters (U+0000 to
# U+001F), which JSON forbids unescaped: json.loads refused ~6% of sampled outputs of a schema with
# bounded strings on a Qwen-sized vocabulary. Its unbounded strings already exclude them.
_BOUNDED_STRING_CHAR = '([^\\"\\\\\\r\\n])'
_JSON_STRING_CHAR = '([^\\0-\\x1f\\"\\\\\\r\\n])'


def _json_schema_grammar(spec: str) -> Any:
    """The schema's grammar: fixed separators and no free whitespace (a weak or random model
    otherwise loops on whitespace until max_new_tokens: vLLM's and SGLang's disable-any-whitespace),
    and strings that never hold a raw control character."""
    xgrammar = _import_xgrammar()
    grammar = xgrammar.Grammar.from_json_schema(spec, any_whitespace=False)
    text = str(grammar)
    if _BOUNDED_STRING_CHAR not in text:
        return grammar
    return xgrammar.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def compiled_size(compiled: Any, spec: str) -> int:
    """Bytes a compiled grammar holds: xgrammar's count (0.2.x has memory_size_bytes), scaled by
    what RSS showed (20 kept grammars grew RSS by 1.33x their count for 2,500 required properties,
    1.45x for 300 optional ones: allocator overhead), plus its spec."""
    return int(RSS_PER_COUNTED_BYTE * (getattr(compiled, "memory_size_bytes", 0) or 0)) + len(spec)


def release_freed_memory() -> None:
    """Hand the heap that freed compiles leave back to the OS (glibc keeps it otherwise: RSS grew
    by ~60x what the compiled grammar holds). A no-op where there is no glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _check_json(kind: str, spec: str) -> Any:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid {kind}: not valid JSON ({exc})") from None


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured output (json_schema, regex, ebnf, structural_tag) needs xgrammar: "
                         "pip install xgrammar") from None
    return xgrammar


def _reason(exc: Exception) -> str:
    """xgrammar's message without the C++ log prefix it carries ("[05:50:33] /project/cpp/x.cc:5082: "):
    the client reads what is wrong with its grammar, not where xgrammar noticed it."""
    return _LOG_PREFIX.sub("", str(exc)).strip() or type(exc).__name__

"""RequestIntake: requests entering the core, and aborts of those not yet running.

A new request gets its detokenizer (when the core decodes its text) and, if constrained, waits
in the grammar queue while its grammar compiles off the loop; then it joins the scheduler's
waiting queue. An abort ends a request still compiling or waiting at once; a running one is
marked and released by the next step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from engine.config import ServerArgs
from engine.core.messages import ReqInput, ReqOutput
from engine.core.results import StepResults
from engine.core.setup import CoreParts
from engine.finish_reasons import abort_reason
from engine.grammar.compile_queue import GrammarQueue
from engine.grammar.compiler import GrammarCompiler, grammar_spec
from engine.grammar.matcher import RequestGrammar
from engine.grammar.matcher_client import MatcherClient, grammar_backend_for
from engine.scheduler.request import Req


# SGLang's message for a request aborted before it ran: AReaL and others branch on it (no output to read)
ABORT_BEFORE_PREFILL = "Abort before prefill"


class RequestIntake:
    def __init__(self, parts: CoreParts, grammars: GrammarQueue, results: StepResults,
                 resolve_lora: Callable[[Optional[str]], Optional[int]] = lambda path: None) -> None:
        self.parts = parts
        self.resolve_lora = resolve_lora  # lora_path -> adapter id (engine/core/lora_control.py)
        self.scheduler = parts.scheduler
        self.grammars = grammars
        self.results = results

    def add(self, msg: ReqInput) -> list[ReqOutput]:
        req = Req.from_input(msg)
        try:  # the front end checked it; an adapter unloaded since is refused here
            req.lora_id = self.resolve_lora(msg.lora_path)
        except ValueError as exc:
            req.finished_reason = abort_reason(str(exc), status_code=400)
            return [self.results.error(req, str(exc))]
        if self.parts.tokenizer is not None and msg.core_detokenizes:  # else the front end decodes the final ids
            req.detokenizer = self.parts.make_detokenizer(req)
        spec = grammar_spec(req.sampling_params)  # compiled again here: compiled grammars do not pickle
        if spec is not None:
            req.grammar = self.grammars.submit(req, spec)
            if req.grammar is None:  # compiling: admit_compiled queues it once its grammar is in
                return []
        self.scheduler.add_request(req)
        return []

    def admit_compiled(self) -> list[ReqOutput]:
        """Queue the requests whose grammar compiled; a grammar that failed (the front end checked
        it already: only a core without tokenizer or xgrammar) fails its request."""
        outputs = []
        for req, grammar, error in self.grammars.pop_ready():
            if error is not None:
                outputs.append(self.results.error(req, error))
            else:
                req.grammar = grammar
                self.scheduler.add_request(req)
        return outputs

    def abort(self, rid: Optional[str], message: str, prefix: bool = False) -> list[ReqOutput]:
        """Abort one request (with `prefix`, every one whose rid starts with rid), or every one when
        rid is None; answers those that ended now."""
        outputs: list[ReqOutput] = []
        for rid in self._rids_named(rid, prefix) if rid is not None else self._all_rids():
            req = self.grammars.remove(rid)
            if req is not None:  # still compiling its grammar: it never reached the scheduler
                req.finished_reason = abort_reason(ABORT_BEFORE_PREFILL)
            else:
                req = self.scheduler.abort_request(rid, message)
            if req is not None and req.finished:  # it was waiting: finished right away
                req.finished_reason["message"] = ABORT_BEFORE_PREFILL
                outputs.append(self.results.finish(req))
        return outputs

    def _rids_named(self, rid: str, prefix: bool = False) -> list[str]:
        """rid itself; or, when no request has it, the requests it was expanded into: the n
        samples (rid-0, rid-1, ...) or the batch's prompts (rid_0, ...), as a client knows only
        the rid it sent (SGLang's abort matches rid prefixes). With `prefix`: every rid starting
        with it."""
        rids = self._all_rids()
        if prefix:
            return [r for r in rids if r.startswith(rid)]
        if rid in rids:
            return [rid]
        return [r for r in rids if r.startswith((rid + "-", rid + "_"))]

    def _all_rids(self) -> list[str]:
        s = self.scheduler
        return self.grammars.rids() + [r.rid for r in list(s.waiting) + s.active()]


def grammar_queue(args: ServerArgs, parts: CoreParts) -> GrammarQueue:
    """Constrained requests wait here while their grammar compiles, off the loop."""
    return GrammarQueue(lambda: GrammarCompiler(parts.tokenizer, parts.vocab_size, parts.eos_token_ids,
                                                cache_bytes=args.grammar_cache_bytes),
                        _grammar_backend(args, parts), args.grammar_compile_workers, args.grammar_compile_timeout)


def _grammar_backend(args: ServerArgs, parts: CoreParts) -> Callable[[Any, tuple[str, str]], Any]:
    """How a compiled grammar becomes a request's matcher: here (thread backend), or in the
    grammar process, which then also advances matchers and fills masks for the runner."""
    runner = parts.runner
    if grammar_backend_for(args.grammar_backend, runner.device) != "process":
        return lambda compiled, spec: RequestGrammar(compiled)
    client = MatcherClient(args.tokenizer_path or args.model_path, parts.vocab_size,
                           parts.eos_token_ids, runner.device, step_timeout_s=args.grammar_step_timeout,
                           cache_bytes=args.grammar_cache_bytes)
    runner.use_grammar_backend(client, client.ring)
    if parts.tokenizer is not None:
        client.warm()
    return lambda compiled, spec: client.new(*spec, compiled.tokenizer_info.stop_token_ids)

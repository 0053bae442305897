"""The engine core's side of structured outputs: grammars compiled off the step loop, one
matcher per constrained sequence, and the step's token bitmask.

Compiling a grammar against the vocabulary takes milliseconds to seconds (a large schema), so
it runs on a worker thread (xgrammar's compiler releases the GIL) while the core keeps
stepping the other requests; a sequence joins the scheduler only once its grammar is ready.
Compiled grammars are cached by their serialized form: the same schema sent again costs
nothing. The vocabulary's token strings come from the model's tokenizer, loaded once on that
thread the first time a constrained request arrives.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvfleet.runtime.engine.request import Request

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (each holds a per-state token cache: 0.1-10 MB)


class GrammarViolation(RuntimeError):
    """The sampled token is not one the grammar allows: a defect, since the mask forbids it."""


class UnsatisfiableConstraint(RuntimeError):
    """No token of the vocabulary can continue the output under its constraint (e.g. a regex
    of characters the tokenizer cannot write)."""


@dataclass(slots=True)
class SequenceGrammar:
    """One sequence's constraint: its compiled grammar (on the way) and, once it samples, its
    matcher, which follows the tokens the sequence has produced."""

    compiled: Future[Any]
    stop_token_ids: list[int]
    matcher: Any = field(default=None)

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    def _matcher(self) -> Any:
        if self.matcher is None:
            import xgrammar as xgr

            # A failed compile raises here, in the sampler: the core then fails this request.
            self.matcher = xgr.GrammarMatcher(
                self.compiled.result(), override_stop_tokens=self.stop_token_ids
            )
        return self.matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]`."""
        self._matcher().fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if not self._matcher().accept_token(token):
            raise GrammarViolation(f"token {token} is not allowed by the request's grammar")

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self.matcher is not None and self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles serialized grammars (structured_outputs.grammar_of) for one model's vocabulary,
    on a worker thread, with a cache."""

    def __init__(self, vocab_size: int, load_tokenizer: Callable[[], Any]) -> None:
        self.vocab_size = vocab_size
        self._load_tokenizer = load_tokenizer
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compiler")
        self._compiler: Any = None
        self._cache: OrderedDict[str, Future[Any]] = OrderedDict()

    def compile(self, grammar: str) -> Future[Any]:
        """The compiled grammar, now (cached) or on its way."""
        future = self._cache.get(grammar)
        if future is not None:
            self._cache.move_to_end(grammar)
            return future
        future = self._executor.submit(self._compile, grammar)
        self._cache[grammar] = future
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, grammar: str) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            tokenizer = self._load_tokenizer()
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            log.info("structured outputs: grammar compiler ready (%d tokens)", self.vocab_size)
        return self._compiler.compile_grammar(xgr.Grammar.deserialize_json(grammar))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class CompilingRequests:
    """Constrained sequences whose grammar is still compiling, in arrival order."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self._compiler = compiler
        self._requests: dict[str, Request] = {}

    def add(self, r: Request, grammar: str) -> None:
        """Start (or reuse) the compile of `r`'s grammar; its matcher stops on its stop tokens."""
        stop_ids = sorted(r.eos_token_ids | set(r.params.stop_token_ids))
        r.grammar = SequenceGrammar(self._compiler.compile(grammar), stop_ids)
        self._requests[r.request_id] = r

    def take_ready(self, wait: bool) -> list[Request]:
        """Remove and return those whose grammar is ready; `wait`: first wait up to 50 ms for
        one to be."""
        if wait:
            pending = {r.grammar.compiled for r in self if r.grammar is not None}
            concurrent.futures.wait(pending, timeout=0.05, return_when="FIRST_COMPLETED")
        ready = [r for r in self if r.grammar is not None and r.grammar.ready]
        for r in ready:
            del self._requests[r.request_id]
        return ready

    def pop(self, request_id: str, default: Request | None = None) -> Request | None:
        return self._requests.pop(request_id, default)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests.values()))

    def __len__(self) -> int:
        return len(self._requests)


class TokenBitmask:
    """The step's allowed-token mask: one int32 row of vocab/32 words per sampled row, filled
    only for the constrained rows and applied to those rows only, in one call."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, grammars: list[tuple[int, SequenceGrammar]]) -> None:
        """Set to -inf, in place, every logit the row's grammar forbids."""
        import xgrammar as xgr

        rows, vocab = logits.shape
        host = self._host
        if host is None or host.shape[0] < rows or host.shape[1] * 32 < vocab:
            host = self._host = xgr.allocate_token_bitmask(max(rows, 8), vocab)
            if logits.device.type == "cuda":
                host = self._host = host.pin_memory()
        for row, grammar in grammars:
            grammar.fill(host, row)
            if not bool(host[row].any()):
                raise UnsatisfiableConstraint(
                    "no token of the model's vocabulary can continue the output under the "
                    "request's structured-output constraint"
                )
        mask = host[:rows]
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(
            logits, mask, vocab_size=vocab, indices=[row for row, _ in grammars]
        )

"""Speculative decoding's engine-side part: after each step, draft tokens for the sequences that
decode (prompt lookup or a draft model); after the next, how many of them the model accepted.

The verification itself is the ordinary step: the scheduler budgets a sequence's drafts beside
its last token, the model runner computes one row per token, and the sampler keeps each draft
the target model's distribution agrees with (greedy: exactly the tokens it would have chosen;
sampling: rejection sampling, the same distribution). A sequence then gains its accepted drafts
and one token of the model's own: at least what a step without speculation gives.

Sequences whose next token depends on the tokens before it in ways a row cannot see while the
drafts are unconfirmed (a structured-output grammar, repetition/presence/frequency penalties,
min_tokens still owed) do not speculate; they share the batch unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvfleet.runtime.engine.ngram_proposer import propose_ngram
from kvfleet.runtime.engine.request import Request, RequestStatus
from kvfleet.runtime.engine.speculative_config import SpeculativeConfig
from kvfleet.runtime.engine.token_logprob import TokenLogprob

if TYPE_CHECKING:
    from kvfleet.runtime.engine.core import EngineCore
    from kvfleet.runtime.engine.draft_proposer import DraftModel, DraftProposer

Pick = tuple[int, TokenLogprob | None]


@dataclass(slots=True)
class SpecDecodeCounters:
    """vLLM's spec_decode counters: proposals, draft tokens, and those accepted (in all and by
    position in the proposal)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass(slots=True)
class VerifiedRows:
    """One request's rows of a step: the tokens it keeps, and how many computed tokens it gives
    back (its rejected drafts, whose K/V the next step overwrites)."""

    request: Request
    picks: list[Pick | Exception]
    rejected: int = 0


class Speculator:
    """Proposes drafts, counts what verification made of them."""

    def __init__(
        self, config: SpeculativeConfig, draft: DraftProposer | None = None, max_rows: int = 0
    ) -> None:
        self.config = config
        self.draft = draft
        # The most rows a decode step may have with its drafts (0: no limit): past the rows
        # the step's fast path takes, a verify step costs more than its drafts can save.
        self.max_rows = max_rows
        self.enabled = True  # benchmarks turn it off for their baseline turns
        self.counters = SpecDecodeCounters(
            accepted_per_position=[0] * config.num_speculative_tokens
        )

    def propose(self, running: list[Request], max_model_len: int) -> None:
        """Set the drafts of each running sequence that decodes next; none above
        disable_by_batch_size running sequences (a default chosen, not measured between 1 and
        32 streams: docs/benchmarks.md, "Speculative decoding")."""
        c = self.config
        if not self.enabled or len(running) > c.disable_by_batch_size:
            for r in running:
                r.spec_token_ids.clear()
            return
        wanted: list[tuple[Request, int]] = []
        for r in running:
            r.spec_token_ids.clear()
            if r.num_computed_tokens != r.num_tokens - 1 or not _may_speculate(r):
                continue
            # The step emits at most k + 1 tokens: no drafts past max_tokens or the context.
            k = min(
                c.num_speculative_tokens,
                r.max_tokens - r.num_output_tokens - 1,
                max_model_len - r.num_tokens,
            )
            if k > 0:
                wanted.append((r, k))
        if self.max_rows and wanted:
            each = (self.max_rows - len(running)) // len(wanted)
            wanted = [(r, min(k, each)) for r, k in wanted] if each > 0 else []
        if self.draft is not None:
            self.draft.propose(wanted)
            return
        for r, k in wanted:
            r.spec_token_ids = propose_ngram(
                r.all_token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max
            )

    def verify(
        self, rows: list[Request], picks: list[Pick | Exception], drafts: list[int] | None
    ) -> Iterator[VerifiedRows]:
        """The step's sampled rows, one entry per request, its picks cut at the first rejected
        draft (the pick there is the model's own token); counted."""
        i = 0
        while i < len(rows):
            r = rows[i]
            j = i + 1
            while j < len(rows) and rows[j] is r:
                j += 1
            if drafts is None or j - i == 1:
                yield VerifiedRows(r, picks[i:j])
            else:
                yield self._cut(r, picks[i:j], drafts[i : j - 1])
            i = j

    def _cut(self, r: Request, picks: list[Pick | Exception], drafts: list[int]) -> VerifiedRows:
        accepted = 0
        for pick, draft in zip(picks, drafts, strict=False):
            if isinstance(pick, Exception) or pick[0] != draft:
                break
            accepted += 1
        c = self.counters
        c.drafts += 1
        c.draft_tokens += len(drafts)
        c.accepted_tokens += accepted
        for pos in range(accepted):
            c.accepted_per_position[pos] += 1
        return VerifiedRows(r, picks[: accepted + 1], len(drafts) - accepted)

    def stats_fields(self) -> dict[str, object]:
        """The counters as EngineStats' spec_* fields."""
        c = self.counters
        return {
            "spec_drafts": c.drafts,
            "spec_draft_tokens": c.draft_tokens,
            "spec_accepted_tokens": c.accepted_tokens,
            "spec_accepted_per_position": list(c.accepted_per_position),
        }

    def forget(self, request: Request) -> None:
        """The request ended or was preempted: its drafts (and draft-model cache) go."""
        request.spec_token_ids.clear()
        if self.draft is not None:
            self.draft.free(request)


def verified_rows(
    spec: Speculator | None,
    rows: list[Request],
    picks: list[Pick | Exception],
    drafts: list[int] | None,
) -> Iterator[VerifiedRows]:
    """The step's sampled rows by request (each its own entry where nothing speculates)."""
    if spec is None:
        return (VerifiedRows(r, [pick]) for r, pick in zip(rows, picks, strict=True))
    return spec.verify(rows, picks, drafts)


def load_draft_model(core: EngineCore) -> DraftModel | None:
    """The draft model's weights where the config names one (before the KV budget is read)."""
    spec = core.config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    from kvfleet.runtime.engine.draft_proposer import load_draft

    return load_draft(core)


def build_speculator(core: EngineCore, draft: DraftModel | None) -> Speculator:
    """The speculator `core.config.speculative_config` describes, over `draft` if any."""
    spec = core.config.speculative_config
    assert spec is not None
    proposer = None
    if draft is not None:
        from kvfleet.runtime.engine.draft_proposer import DraftProposer

        proposer = DraftProposer(draft, core)
    return Speculator(spec, proposer, verify_row_limit(core))


def verify_row_limit(core: EngineCore) -> int:
    """For a quantized model on CPU, the rows its quantized GEMM takes: past them every weight is
    dequantized each step, a cost drafts do not earn back. Else no limit (0)."""
    if core.device.type != "cpu":
        return 0
    from kvfleet.kernels.quant_weight import QuantizedWeight
    from kvfleet.runtime.models.llama import PROJECTIONS

    layer = core.model.layers[0]
    if any(isinstance(getattr(layer, name, None), QuantizedWeight) for name in PROJECTIONS):
        from kvfleet.kernels.cpu import cpu_gemm_quant

        return cpu_gemm_quant.max_rows(core.model.kernels.policy)
    return 0


def _may_speculate(r: Request) -> bool:
    p = r.params
    return (
        r.status is RequestStatus.RUNNING
        and r.grammar is None
        and not p.uses_penalties
        and r.num_output_tokens >= p.min_tokens
    )

"""Turn each scheduled request's last-token logits into its next token.

Batched over requests; the only per-request work is for the few that ask for penalties or a
seed (the logit biases of the whole batch go in with one indexed add). A seeded request draws
its noise from its own generator, so its tokens do not depend on what else is in the batch.
Sampling uses the exponential-race form of the Gumbel-max trick (argmax p/q with q ~ Exp(1)),
which draws from softmax without a cumulative sum.

Sampling runs where the logits are: on a GPU only the chosen tokens (and any logprobs asked
for) come back to the host, not a [rows, vocab] float32 block per step (65 MB at 128 rows of a
128k vocabulary). A seeded request's noise is drawn on the host from its own CPU generator, so
a seed gives the same noise on every kind of machine.
"""

from __future__ import annotations

import logging

import torch
from kvfleet.kernels import dispatch
from kvfleet.runtime.engine.grammar_matchers import TokenBitmask
from kvfleet.runtime.engine.request import Request
from kvfleet.runtime.engine.token_logprob import TokenLogprob
from kvfleet.runtime.engine.transfers import to_device, upload

log = logging.getLogger(__name__)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.bitmask = TokenBitmask()

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        argmax: list[int] | None = None,
        drafts: list[int] | None = None,
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Each row's token and logprob entry, on the host (see `sample`)."""
        tokens, logprobs = self.sample(logits, requests, argmax, drafts)
        return (tokens if isinstance(tokens, list) else tokens.tolist()), logprobs

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        argmax: list[int] | None = None,
        drafts: list[int] | None = None,
    ) -> tuple[torch.Tensor | list[int], list[TokenLogprob | None]]:
        """logits: float32 [len(requests), vocab] on the sampler's device, left unchanged (the
        engine samples rows again one by one when a batch fails, from the same logits).
        `argmax`: each row's argmax of `logits` where the caller has it (the one-call CPU decode
        step computes it): greedy rows take it unless a bias or constraint changed the row.
        `drafts` (speculative decoding): each row's draft token, -1 for none. A row returns
        its draft when it accepts it, else a token that is not the draft (see `_verify`).
        The tokens stay on the device (a list where `argmax` gave them): only logprobs, where
        a row asks for them, make the host wait for the sampling to end."""
        # Returned logprobs are the model's own distribution: taken before logit_bias, penalties
        # and min_tokens, as vLLM's default does, so a forced token shows how unlikely it was.
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        given = logits
        logits = self._apply_logit_bias(logits, requests)
        logits = self._apply_constraints(logits, requests)
        grammars = [(i, r.grammar) for i, r in enumerate(requests) if r.grammar is not None]
        if grammars:
            # Structured outputs: every token a constrained row's grammar forbids is masked,
            # in one call for all such rows; unconstrained rows are not touched.
            logits = logits.clone() if logits is given else logits
            self.bitmask.apply(logits, grammars)

        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        tokens: torch.Tensor | list[int]
        if len(greedy) == len(requests) and argmax is not None and logits is given:
            tokens = list(argmax)
        elif len(greedy) == len(requests):
            tokens = dispatch.argmax(logits)
        else:
            tokens = self._sample(logits, requests, drafts)
            if greedy:
                idx = to_device(greedy, torch.long, logits.device)
                tokens[idx] = dispatch.argmax(logits[idx])

        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        if raw_logprobs is not None:
            token_list = tokens if isinstance(tokens, list) else tokens.tolist()
            for i, r in enumerate(requests):
                n = r.params.logprobs
                if n is None:
                    continue
                top: list[tuple[int, float]] = []
                if n > 0:
                    vals, ids = raw_logprobs[i].topk(n)
                    top = list(zip(ids.tolist(), vals.tolist(), strict=True))
                tok = token_list[i]
                logprobs[i] = TokenLogprob(tok, float(raw_logprobs[i, tok]), top)
        return tokens, logprobs

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Add each request's logit_bias to its row: one indexed add for all biased rows."""
        biased = [(i, r.params.logit_bias) for i, r in enumerate(requests) if r.params.logit_bias]
        if not biased:
            return logits
        rows = [i for i, bias in biased for _ in bias]
        cols = [t for _, bias in biased for t in bias]
        values = [v for _, bias in biased for v in bias.values()]
        dev = logits.device
        index = (to_device(rows, torch.long, dev), to_device(cols, torch.long, dev))
        bias = to_device(values, logits.dtype, dev)
        return logits.index_put(index, bias, accumulate=True)

    @staticmethod
    def _apply_constraints(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Penalties and min_tokens: per request, only for the requests that use them."""
        if not any(
            r.params.uses_penalties or r.num_output_tokens < r.params.min_tokens for r in requests
        ):
            return logits
        logits = logits.clone()
        dev = logits.device
        for i, r in enumerate(requests):
            p = r.params
            if p.uses_penalties:
                row = logits[i]
                out_ids = torch.tensor(r.output_token_ids, dtype=torch.long, device=dev)
                if p.repetition_penalty != 1.0:
                    seen = torch.tensor(r.all_token_ids, dtype=torch.long, device=dev).unique()
                    vals = row[seen]
                    row[seen] = torch.where(
                        vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                    )
                if out_ids.numel() and (p.presence_penalty or p.frequency_penalty):
                    counts = torch.bincount(out_ids, minlength=row.numel()).to(row.dtype)
                    row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            if r.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.extend(r.eos_token_ids)
                if banned:
                    logits[i, to_device(banned, torch.long, dev)] = float("-inf")
        return logits

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], drafts: list[int] | None = None
    ) -> torch.Tensor:
        probs = self._probs(logits, requests)
        if drafts is None or all(d < 0 for d in drafts):
            return self._race(probs, requests)
        return self._verify(probs, requests, drafts)

    def _verify(
        self, probs: torch.Tensor, requests: list[Request], drafts: list[int]
    ) -> torch.Tensor:
        """Rejection sampling against drafts that are single tokens (a point-mass proposal,
        as prompt lookup and greedy draft models make): a row keeps its draft d with
        probability p(d), else draws from p with d removed, renormalised. Either way its token
        has distribution p exactly: P(d) = p(d), P(x) = (1 - p(d)) p(x) / (1 - p(d))."""
        dev = probs.device
        rows = [i for i, d in enumerate(drafts) if d >= 0]
        index = torch.tensor(rows, device=dev)
        draft = torch.tensor([drafts[i] for i in rows], device=dev)
        p_draft = probs[index, draft]
        uniform = torch.rand(len(rows), generator=self.generator, device=dev)
        for j, i in enumerate(rows):
            g = requests[i].generator
            if g is not None:  # a seed gives the same draws on every machine
                uniform[j] = torch.rand((), generator=g).item()
        residual = probs.clone()
        residual[index, draft] = 0.0
        tokens = self._race(residual, requests)
        tokens[index] = torch.where(uniform < p_draft, draft, tokens[index])
        return tokens

    def _probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each row's sampling distribution: temperature, top-k, top-p and min-p applied."""
        dev = logits.device
        temps = to_device([r.params.temperature or 1.0 for r in requests], logits.dtype, dev)
        logits = logits / temps[:, None]
        top_k = [r.params.top_k for r in requests]
        top_p = [r.params.top_p for r in requests]
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = [r.params.min_p for r in requests]
        if any(min_p):
            mp = to_device(min_p, probs.dtype, dev)[:, None]
            probs = probs.masked_fill(probs < mp * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs

    def _race(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One token per row, drawn from `probs` (unnormalised is fine) by the race."""
        dev = probs.device
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(requests):
            if r.generator is None:
                continue
            if dev.type == "cpu":
                noise[i].exponential_(generator=r.generator)
            else:
                row = torch.empty(probs.shape[-1], dtype=probs.dtype)
                noise[i].copy_(upload(row.exponential_(generator=r.generator), dev))
        return dispatch.argmax(probs / noise)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus (the top token always stays)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    dev = logits.device
    k = to_device([t if t > 0 else vocab for t in top_k], torch.long, dev)
    ranks = torch.arange(vocab, device=dev)[None, :]
    mask = ranks >= k[:, None]
    p = to_device(top_p, logits.dtype, dev)[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p.
    mask |= (probs.cumsum(dim=-1) - probs) >= p
    mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_isolated(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[Request],
    argmax: list[int] | None = None,
    drafts: list[int] | None = None,
) -> list[tuple[int, TokenLogprob | None] | Exception]:
    """Each row's (token, logprob); where sampling the batch fails, the rows are sampled one at a
    time so that only the requests whose own rows fail get an exception."""
    if not rows:
        return []
    extra = {} if drafts is None else {"drafts": drafts}
    try:
        tokens, logprobs = sampler(logits, rows, argmax, **extra)
        return list(zip(tokens, logprobs, strict=True))
    except Exception:
        log.warning("sampling %d rows failed; sampling them one by one", len(rows), exc_info=True)
    picks: list[tuple[int, TokenLogprob | None] | Exception] = []
    for i, r in enumerate(rows):
        try:
            one = {} if drafts is None else {"drafts": drafts[i : i + 1]}
            tokens, logprobs = sampler(logits[i : i + 1], [r], **one)
            picks.append((tokens[0], logprobs[0]))
        except Exception as exc:
            picks.append(exc)
    return picks

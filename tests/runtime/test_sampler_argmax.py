"""Greedy sampling takes the argmaxes a step already computed (the one-call CPU decode step
hands them over) only where nothing changed the logits after them: a logit_bias or a
min_tokens ban still decides the token."""

from __future__ import annotations

import torch
from kvfleet.runtime.engine.request import Request
from kvfleet.runtime.engine.sampler import Sampler
from kvfleet.runtime.engine.sampling_params import SamplingParams

VOCAB = 8
EOS = 7


def _request(params: SamplingParams) -> Request:
    return Request("r", [1, 2, 3], params, frozenset({EOS}), params.max_tokens or 16)


def _logits() -> torch.Tensor:
    logits = torch.zeros(2, VOCAB)
    logits[0, 5] = 3.0
    logits[1, EOS] = 3.0
    logits[1, 2] = 1.0
    return logits


def test_greedy_rows_take_the_steps_argmaxes():
    rows = [_request(SamplingParams(temperature=0.0)) for _ in range(2)]
    tokens, _ = Sampler()(_logits(), rows, argmax=[5, EOS])
    assert tokens == [5, EOS]


def test_a_logit_bias_decides_over_the_steps_argmaxes():
    rows = [
        _request(SamplingParams(temperature=0.0, logit_bias={4: 10.0})),
        _request(SamplingParams(temperature=0.0)),
    ]
    tokens, _ = Sampler()(_logits(), rows, argmax=[5, EOS])
    assert tokens == [4, EOS]


def test_a_min_tokens_ban_decides_over_the_steps_argmaxes():
    rows = [
        _request(SamplingParams(temperature=0.0)),
        _request(SamplingParams(temperature=0.0, min_tokens=2)),  # EOS banned for now
    ]
    tokens, _ = Sampler()(_logits(), rows, argmax=[5, EOS])
    assert tokens == [5, 2]


def test_without_argmaxes_greedy_rows_take_the_logits_argmax():
    rows = [_request(SamplingParams(temperature=0.0)) for _ in range(2)]
    tokens, _ = Sampler()(_logits(), rows)
    assert tokens == [5, EOS]

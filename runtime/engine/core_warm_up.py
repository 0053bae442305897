"""The engine core's warm-up: short generations outside every counter, before it reports ready.

The first proves the model, cache and sampler work and takes first-call costs out of
benchmarks; with --max-step-time-ratio the next give the step-time model steps of many shapes
to size prompt shares from before the first request — decodes of 7 rows down to 1 as sequences
end one by one, and prefills of four sizes: the first comes before any decode step to measure
it against, the other three give the prompt fit's three terms (step_time.py) a point each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfleet.runtime.engine.core_messages import CoreRequest
from kvfleet.runtime.engine.kv_cache_manager import PrefixCacheStats
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.engine.step_time import PromptPace, StepTimeModel

if TYPE_CHECKING:
    from kvfleet.runtime.engine.core import EngineCore


def warm_up(core: EngineCore) -> None:
    """Run the warm-up generations on `core`, then zero its counters and prefix-cache stats."""
    from kvfleet.runtime.engine.core import EngineCounters

    vocab = core.model_config.vocab_size
    longest = max(core.max_model_len - 9, 8)
    step_log, core.step_log = core.step_log, None  # a --step-log holds the served steps only
    try:
        _generate_unseen(core, [(8, 2)], vocab)
        if core.scheduler.step_times is not None:  # only the prompt bound reads step times
            core.scheduler.step_times = StepTimeModel()  # first calls are slow: forget them
            shapes = [(min(16 * (k + 1), longest), k + 1) for k in range(8)]
            _generate_unseen(core, shapes, vocab)
            _generate_unseen(core, [(min(64, longest), 2)] * 2, vocab)
            _generate_unseen(core, [(min(24, longest), 2)], vocab)
            _generate_unseen(core, [(min(256, longest), 2)], vocab)
            core.scheduler.pace = PromptPace()  # its prompts are no arrivals to keep pace with
    finally:
        core.step_log = step_log
    core.counters = EngineCounters()
    core.kv.stats = PrefixCacheStats()


def _generate_unseen(core: EngineCore, shapes: list[tuple[int, int]], vocab: int) -> None:
    """Run prompts of (length, output tokens) to their end, together."""
    ids = [f"__warmup_{i}__" for i in range(len(shapes))]
    requests = []
    for k, (rid, (length, tokens)) in enumerate(zip(ids, shapes, strict=True)):
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        # Distinct prompts, none seen before: no prefix-cache hit shrinks a prefill.
        prompt = [(i * 7 + 13 * k + 31 * length + 1) % vocab for i in range(length)]
        requests.append(CoreRequest(rid, prompt, params, frozenset(), tokens, rid, 0, 0.0))
    core.add(requests)
    try:
        while core.has_unfinished():
            core.step()
    finally:
        core.abort(ids)

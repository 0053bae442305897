"""A prompt the engine core refused when it was added ends at once with an error delta, its
sequences counted as failed, and is forgotten: later outputs for it are ignored."""

from __future__ import annotations

from pathlib import Path

from kvfleet.runtime.engine.core_messages import CoreRequest, SequenceOutput
from kvfleet.runtime.engine.output_processor import OutputProcessor, RequestDelta
from kvfleet.runtime.engine.sampling_params import SamplingParams


class Finishes:
    """A SequenceObserver that records how sequences end."""

    def __init__(self) -> None:
        self.reasons: list[str | None] = []

    def on_first_token(self, seq, now: float) -> None: ...

    def on_token(self, seq, now: float) -> None: ...

    def on_finished(self, seq, now: float) -> None:
        self.reasons.append(seq.finish_reason)


def test_a_refused_prompt_ends_with_an_error_and_later_outputs_are_ignored(tiny_llama_dir: Path):
    from transformers import AutoTokenizer

    observer = Finishes()
    outputs = OutputProcessor(AutoTokenizer.from_pretrained(tiny_llama_dir), observer)
    params = SamplingParams(n=2, max_tokens=4)
    sequences = [
        CoreRequest(f"g#{i}", [1, 2, 3], params, frozenset(), 4, "g", i, 0.0) for i in range(2)
    ]
    deltas: list[RequestDelta] = []
    outputs.add(0, sequences, deltas.append)

    outputs.fail("g", "request_id: 'g#0' is already in use", now=1.0)

    assert [(d.finished, d.error) for d in deltas] == [
        (True, "request_id: 'g#0' is already in use")
    ]
    assert observer.reasons == ["error", "error"]
    assert len(outputs) == 0
    assert outputs.process([SequenceOutput("g#0", [5])], now=2.0) == {}
    assert len(deltas) == 1

"""One request's failure stays with that request: the engine finishes it with finish_reason
"error" (its blocks freed, its output saying why) and goes on generating for everyone else,
exactly as it would have without it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.engine import output_processor as engine_module
from kvfleet.runtime.engine.detokenizer import IncrementalDetokenizer

# Requests carrying one of these stop strings are the ones an injected fault picks on; they
# never occur in the tiny model's output, so they change nothing else about them.
SAMPLER_FAULT = "\x00sampler fault\x00"
DETOKENIZER_FAULT = "\x00detokenizer fault\x00"
MARKS = {"sampler": SAMPLER_FAULT, "detokenizer": DETOKENIZER_FAULT}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, max_num_seqs=8)


class _FaultySampler:
    """The engine's sampler, raising for any batch that holds a marked request."""

    def __init__(self, real) -> None:
        self.real = real

    def __call__(self, logits, requests, argmax=None):
        if any(SAMPLER_FAULT in r.params.stop for r in requests):
            raise RuntimeError("injected sampler fault")
        return self.real(logits, requests, argmax)


class _FaultyDetokenizer(IncrementalDetokenizer):
    """Raises on a marked request's third token."""

    def add(self, token_id: int, check_stop: bool) -> str | None:
        if DETOKENIZER_FAULT in self.stop:
            self.adds = getattr(self, "adds", 0) + 1
            if self.adds == 3:
                raise ValueError("injected detokenizer fault")
        return super().add(token_id, check_stop)


@pytest.fixture
def faults(llm: LLM, monkeypatch: pytest.MonkeyPatch):
    """Install both faults on the module's engine (undone after the test)."""
    monkeypatch.setattr(llm.engine.core, "sampler", _FaultySampler(llm.engine.core.sampler))
    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", _FaultyDetokenizer)
    return llm


def _assert_engine_clean(llm: LLM) -> None:
    e = llm.engine
    assert not e.has_unfinished_requests()
    assert e.kv.usage == 0.0, "blocks leaked"
    assert not e._requests and not len(e.outputs) and not e.core.scheduler.requests


def test_a_sampling_fault_fails_that_request_only(llm: LLM, faults: LLM) -> None:
    prompts = [[101, 2025, 318, 257], [7, 8, 9], [42, 43, 44, 45, 46]]
    good = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    bad = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[SAMPLER_FAULT], n=2)
    alone = [llm.generate([p], good)[0].outputs[0].token_ids for p in prompts[::2]]

    outs = llm.generate(prompts, [good, bad, good])

    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    assert outs[0].error is None and outs[2].error is None
    failed = outs[1]
    assert failed.finished and "injected sampler fault" in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error", "error"]
    assert llm.engine.counters.finished.get("error", 0) >= 2
    _assert_engine_clean(llm)


def test_a_detokenizing_fault_mid_stream_fails_that_request_only(faults: LLM) -> None:
    llm = faults
    good = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    bad = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[DETOKENIZER_FAULT])
    outs = llm.generate([[5, 6, 7], [8, 9, 10]], [bad, good])
    assert "injected detokenizer fault" in outs[0].error
    assert outs[0].outputs[0].finish_reason == "error"
    assert 1 <= len(outs[0].outputs[0].token_ids) < 10  # it failed part-way
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 10
    _assert_engine_clean(llm)


def test_a_failed_add_leaves_nothing_behind(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    made = []

    class BreaksOnTheSecond(IncrementalDetokenizer):
        def __post_init__(self) -> None:
            made.append(self)
            if len(made) == 2:
                raise RuntimeError("injected fault building the second completion")
            super().__post_init__()

    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", BreaksOnTheSecond)
    with pytest.raises(RuntimeError, match="second completion"):
        llm.engine.add_request("broken", [1, 2, 3], SamplingParams(n=3, max_tokens=4))
    _assert_engine_clean(llm)
    monkeypatch.undo()
    out = llm.generate([[1, 2, 3]], SamplingParams(n=3, max_tokens=4, temperature=0))[0]
    assert len(out.outputs) == 3 and out.error is None


def test_seeds_at_the_edges_of_int64_work_for_every_completion(llm: LLM) -> None:
    for seed in (2**63 - 1, -(2**63)):
        out = llm.generate([[1, 2, 3]], SamplingParams(n=3, seed=seed, max_tokens=4))[0]
        assert out.error is None and all(len(c.token_ids) == 4 for c in out.outputs)


request_spec = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(1, 5000), min_size=1, max_size=40),
        "max_tokens": st.integers(1, 12),
        "n": st.integers(1, 3),
        "fault": st.sampled_from([None, None, "sampler", "detokenizer"]),
    }
)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(specs=st.lists(request_spec, min_size=1, max_size=6))
def test_faulty_requests_never_change_what_the_others_get(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, specs: list[dict]
) -> None:
    def params(spec: dict, fault: str | None) -> SamplingParams:
        return SamplingParams(
            temperature=0,
            max_tokens=spec["max_tokens"],
            n=spec["n"],
            ignore_eos=True,
            stop=[MARKS[fault]] if fault else [],
        )

    healthy = [s for s in specs if s["fault"] is None]
    expected = (
        llm.generate([s["prompt"] for s in healthy], [params(s, None) for s in healthy])
        if healthy
        else []
    )

    with monkeypatch.context() as m:
        m.setattr(llm.engine.core, "sampler", _FaultySampler(llm.engine.core.sampler))
        m.setattr(engine_module, "IncrementalDetokenizer", _FaultyDetokenizer)
        # The detokenizer fault needs three tokens; shorter marked requests may finish first.
        outs = llm.generate([s["prompt"] for s in specs], [params(s, s["fault"]) for s in specs])

    got = [o for o, s in zip(outs, specs, strict=True) if s["fault"] is None]
    for o, e in zip(got, expected, strict=True):
        assert o.error is None
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in e.outputs]
    for o, s in zip(outs, specs, strict=True):
        if s["fault"] == "sampler":
            assert o.error is not None and {c.finish_reason for c in o.outputs} == {"error"}
        elif s["fault"] == "detokenizer" and s["max_tokens"] >= 3:
            assert o.error is not None
    _assert_engine_clean(llm)

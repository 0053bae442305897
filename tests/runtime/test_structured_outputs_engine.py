"""Structured outputs in the engine (offline, tiny random model): the constraint holds on a
model that writes noise, a constrained request leaves the tokens of the requests beside it
unchanged, a grammar still compiling holds up nobody else, and a schema sent again is not
compiled again."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import pytest
from kvfleet.runtime import LLM, SamplingParams, StructuredOutputsParams
from kvfleet.runtime.engine.grammar_matchers import GrammarCompiler
from kvfleet.runtime.engine.request_limits import RequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "b"]},
    },
    "required": ["name", "size", "kind"],
}
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, kv_cache_memory="64MiB")


def constrained(**so) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=5, max_tokens=120, structured_outputs=StructuredOutputsParams(**so)
    )


def test_a_random_model_still_writes_what_the_schema_allows(llm):
    outs = llm.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=120,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA)))  # fmt: skip
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_regex_choice_and_grammar_hold_under_sampling(llm):
    (regex,) = llm.generate(["x"], constrained(regex=r"[0-9]{3}-[a-c]{2}"))
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", regex.outputs[0].text)
    (choice,) = llm.generate(["x"], constrained(choice=["left", "right"]))
    assert choice.outputs[0].text in ("left", "right")
    (grammar,) = llm.generate(["x"], constrained(grammar='root ::= "v" [0-9] ("." [0-9])?'))
    assert re.fullmatch(r"v[0-9](\.[0-9])?", grammar.outputs[0].text)


def test_unconstrained_requests_beside_a_constrained_one_get_their_own_tokens(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    mixed = llm.generate(PROMPTS + PROMPTS[:1], [plain] * 4 + [constrained(json=SCHEMA)])
    assert [o.outputs[0].token_ids for o in mixed[:4]] == alone
    jsonschema.validate(json.loads(mixed[4].outputs[0].text), SCHEMA)


def test_a_grammar_still_compiling_holds_up_no_one(llm, monkeypatch):
    release = threading.Event()
    compile_grammar = GrammarCompiler._compile

    def slow(self, grammar):
        release.wait(30)  # the compile ends only when the test says so
        return compile_grammar(self, grammar)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    engine = llm.engine
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "slow": {"const": 1}}}
    engine.add_request("slow", PROMPTS[0], constrained(json=schema))
    engine.add_request("plain", PROMPTS[1], SamplingParams(temperature=0, max_tokens=6))
    done: dict[str, str] = {}
    started = time.monotonic()
    while "plain" not in done and time.monotonic() - started < 60:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].text
    waiting = engine.num_waiting
    release.set()
    assert "plain" in done and "slow" not in done  # served while the grammar compiled
    assert waiting == 1  # the constrained request waits, and is counted as waiting
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].text
    jsonschema.validate(json.loads(done["slow"]), schema)


def test_a_schema_sent_again_is_compiled_once(llm, monkeypatch):
    calls = []
    compile_grammar = GrammarCompiler._compile

    def counted(self, grammar):
        calls.append(grammar)
        return compile_grammar(self, grammar)

    monkeypatch.setattr(GrammarCompiler, "_compile", counted)
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "once": {"const": 1}}}
    for _ in range(3):
        llm.generate(PROMPTS[:2], constrained(json=schema))
    assert len(calls) == 1


def test_a_bad_constraint_is_refused_by_the_offline_api_naming_it(llm):
    with pytest.raises(RequestError) as e:
        llm.generate(["x"], constrained(regex="(unclosed"))
    assert e.value.field == "structured_outputs.regex"


def test_a_property_named_like_a_refused_keyword_is_served(llm):
    schema = {"type": "object", "properties": {"not": {"type": "string", "maxLength": 6}},
              "required": ["not"]}  # fmt: skip
    (out,) = llm.generate(["x"], constrained(json=schema))
    jsonschema.validate(json.loads(out.outputs[0].text), schema)

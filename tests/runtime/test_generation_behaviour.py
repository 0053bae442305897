"""What a user of the offline API notices: seeds, sampling controls, stops, n > 1, bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.engine.config import ConfigError
from kvfleet.runtime.engine.request_limits import RequestError
from kvfleet.runtime.engine.sampling_params import SamplingParamsError
from kvfleet.runtime.models.errors import ModelLoadError


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128)


PROMPT = [101, 2025, 318, 257, 1332, 286, 262, 995]


def test_same_seed_same_tokens_whatever_else_is_in_the_batch(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=20)
    alone = llm.generate([PROMPT], p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.9, seed=s, max_tokens=12) for s in range(5)]
    crowd = llm.generate([[7, 8, 9]] * 5 + [PROMPT], [*others, p])
    assert crowd[-1].outputs[0].token_ids == alone
    other_seed = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=99, max_tokens=20))
    assert other_seed[0].outputs[0].token_ids != alone


def test_top_k_1_is_greedy_and_min_p_1_is_greedy(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0]
    top1 = llm.generate([PROMPT], SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=12))
    minp = llm.generate([PROMPT], SamplingParams(temperature=1.5, min_p=1.0, seed=3, max_tokens=12))
    tiny_p = llm.generate(
        [PROMPT], SamplingParams(temperature=1.5, top_p=1e-6, seed=3, max_tokens=12)
    )
    expected = greedy.outputs[0].token_ids
    assert top1[0].outputs[0].token_ids == expected
    assert minp[0].outputs[0].token_ids == expected
    assert tiny_p[0].outputs[0].token_ids == expected


def test_penalties_change_what_is_generated(llm: LLM) -> None:
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30))[0]
    tokens = base.outputs[0].token_ids
    rep = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=30, repetition_penalty=5.0)
    )[0]
    freq = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=30, frequency_penalty=2.0, presence_penalty=2.0),
    )[0]
    # A strong repetition penalty never repeats a prompt or output token while others exist.
    seen = set(PROMPT)
    for t in rep.outputs[0].token_ids:
        assert t not in seen
        seen.add(t)
    assert freq.outputs[0].token_ids != tokens or len(set(tokens)) == len(tokens)


def test_stop_strings_cut_the_text_and_stop_token_ids_stop(llm: LLM) -> None:
    full = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[4:7]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full.text[: full.text.index(stop)]
    tok = full.token_ids[5]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tok]))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == tok
    assert c.token_ids == full.token_ids[: full.token_ids.index(tok) + 1]


def test_min_tokens_max_tokens_and_ignore_eos(llm: LLM) -> None:
    eos = sorted(llm.engine.eos_token_ids)[0]
    out = llm.generate(
        [PROMPT],
        SamplingParams(
            temperature=0, max_tokens=9, stop_token_ids=[eos], ignore_eos=True, min_tokens=9
        ),
    )[0]
    assert len(out.outputs[0].token_ids) == 9
    assert out.outputs[0].finish_reason == "length"
    assert eos not in out.outputs[0].token_ids


def test_logprobs_are_returned_for_each_token(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 5
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert lp.token_id == tok
        assert len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0


def test_n_completions_share_the_prompt_blocks(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, block_size=8)
    prompt = list(range(1000, 1040))  # 5 full blocks
    engine = llm.engine
    engine.add_request("fan", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8))
    engine.step()
    tables = [engine.kv.blocks_of(f"fan#{i}") for i in range(3)]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]  # the prompt's full blocks, shared
    assert engine.kv.ref_counts[tables[0][0]] == 3
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per completion
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_abort_frees_blocks_at_once(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("gone", PROMPT * 4, SamplingParams(max_tokens=50))
    engine.step()
    assert engine.kv.usage > 0
    assert engine.abort_request("gone")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(logprobs=21), "logprobs"),
    ],
)
def test_bad_sampling_params_name_the_field(make, field: str) -> None:
    with pytest.raises(SamplingParamsError) as e:
        make()
    assert e.value.field == field and field in str(e.value)


def test_too_long_prompt_names_the_limit(llm: LLM) -> None:
    with pytest.raises(RequestError, match="max_model_len is 128"):
        llm.generate([[5] * 200], SamplingParams())
    with pytest.raises(RequestError, match=r"prompt \(100 tokens\) \+ max_tokens \(50\)"):
        llm.generate([[5] * 100], SamplingParams(max_tokens=50))
    assert not llm.engine.has_unfinished_requests()


def test_unknown_model_path_and_bad_config_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="block_size"):
        LLM("bundled", block_size=12)


@pytest.mark.slow
def test_bundled_chat_knows_the_capital_of_france() -> None:
    # float32, where greedy tokens are Hugging Face's: the answer's first token is a near tie
    # ("The" 25.33 against "L" 25.24 in float32 logits), which bfloat16's rounding noise (a mean
    # 0.086 per logit against float32, the same with oneDNN's GEMM and kvfleet's own) decides by
    # its summation order: "L'Étoile..." on the AVX512-BF16 engine, "The capital..." on oneDNN.
    llm = LLM("bundled", dtype="float32", max_model_len=512, kv_cache_memory="256MiB")
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )
    assert "Paris" in out[0].outputs[0].text


def test_cli_generate_prints_the_completion_and_reports_bad_input(tiny_llama_dir: Path) -> None:
    kvfleet = [sys.executable, "-m", "kvfleet.runtime.cli"]
    ok = subprocess.run(
        [
            *kvfleet,
            "generate",
            "--model",
            str(tiny_llama_dir),
            "--prompt",
            "Hello",
            "--max-tokens",
            "5",
            "--dtype",
            "float32",
            "--max-model-len",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip()
    bad = subprocess.run(
        [
            *kvfleet,
            "generate",
            "--model",
            str(tiny_llama_dir),
            "--prompt",
            "Hi",
            "--top-p",
            "2",
            "--max-model-len",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2
    assert "top_p" in bad.stderr and "Traceback" not in bad.stderr


def test_chat_template_variables_reach_the_template():
    llm = LLM("random:tiny", kv_cache_memory="64MiB")
    llm.engine.tokenizer.chat_template = (
        "{{ greeting | default('none') }}:{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    messages = [{"role": "user", "content": "hello"}]
    decode = llm.engine.tokenizer.decode
    assert decode(llm.engine.apply_chat_template(messages)) == "none:hello"
    got = llm.engine.apply_chat_template(messages, template_kwargs={"greeting": "Bonjour"})
    assert decode(got) == "Bonjour:hello"


def test_text_prompts_get_the_tokenizers_bos_and_chat_prompts_only_the_templates(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    # A Llama-3-style tokenizer that prepends BOS: a completion prompt must start with it, as
    # transformers and vLLM encode it, while a chat prompt (whose template writes BOS itself)
    # must not get a second one.
    import json
    import shutil

    folder = tmp_path / "bos-model"
    shutil.copytree(tiny_llama_dir, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    bos = "<|im_start|>"
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [1], "tokens": [bos]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    llm = LLM(str(folder), dtype="float32", max_model_len=128)
    assert llm.tokenizer("hi").input_ids[0] == 1  # the tokenizer really adds it
    out = llm.generate("hi", SamplingParams(max_tokens=1))[0]
    assert out.prompt_token_ids == llm.tokenizer("hi").input_ids
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1))[0]
    assert chat.prompt_token_ids[0] == 1 and chat.prompt_token_ids[1] != 1


@pytest.mark.slow
def test_fp8_kv_cache_holds_twice_the_tokens_and_scores_text_alike() -> None:
    # --kv-cache-dtype fp8 is lossy by design: it must hold twice the tokens in the same memory
    # while the bundled model's log-probabilities of ordinary text stay close to bf16's.
    text = (
        "The capital of France is Paris. It is known for the Eiffel Tower, its museums, "
        "its cafes and a long history of art and science."
    )
    scored = {}
    for kv_dtype in ("auto", "fp8", "fp8_e5m2"):
        llm = LLM(
            "bundled",
            dtype="bfloat16",
            kv_cache_dtype=kv_dtype,
            kv_cache_memory="64MiB",
            max_model_len=1024,
        )
        scored[kv_dtype] = (
            llm.engine.kv.num_blocks,
            llm.generate(text, SamplingParams(max_tokens=1, prompt_logprobs=1))[0],
        )
    blocks, base = scored["auto"]
    for kv_dtype in ("fp8", "fp8_e5m2"):
        fp8_blocks, out = scored[kv_dtype]
        assert fp8_blocks == 2 * blocks
        pairs = list(zip(out.prompt_logprobs[1:], base.prompt_logprobs[1:], strict=True))
        drift = [abs(a.logprob - b.logprob) for a, b in pairs]
        assert sum(drift) / len(drift) < 0.3, kv_dtype
        same_top = sum(a.top[0][0] == b.top[0][0] for a, b in pairs)
        assert same_top >= 0.8 * len(pairs), kv_dtype


def test_unknown_kv_cache_dtype_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_dtype: must be one of auto, fp8"):
        LLM("random:tiny", kv_cache_dtype="int4")

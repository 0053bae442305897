"""Tensor parallelism on CPU (gloo): the model sharded over 2 ranks (this process and a spawned
worker) generates the same greedy tokens as one process, with logits within a measured tolerance; prompt logprobs
(which gather logits chunk by chunk on every rank) agree too; and a rank that dies surfaces as
a clear error, never a hang."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.engine.tp_workers import TPWorkerError
from kvfleet.runtime.models.shard_layout import TensorParallelError

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# Measured on the bundled model, float32, TP=2 against TP=1 (2-core x86 host): the largest
# logit difference over both prompts' 16 steps was 6.6e-05 (logits of magnitude ~20-30); the
# all-reduce sums two partial GEMMs where one process sums all of it at once, so only the
# order of float32 additions differs.
LOGIT_ATOL = 1e-3


class RecordingSampler:
    """The engine's sampler, keeping a copy of every logits batch it is handed."""

    def __init__(self, real) -> None:
        self.real = real
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits, requests, argmax=None):
        self.logits.append(logits.clone())
        return self.real(logits, requests, argmax)


def _run(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor]]:
    recorder = RecordingSampler(llm.engine.core.sampler)
    llm.engine.core.sampler = recorder
    outs = llm.generate(PROMPTS, GREEDY)
    return [o.outputs[0].token_ids for o in outs], recorder.logits


def _options(**extra) -> dict:
    return {"dtype": "float32", "kv_cache_memory": "64MiB", "max_model_len": 512, **extra}


def test_two_ranks_give_the_same_greedy_tokens_as_one_on_the_bundled_model() -> None:
    with LLM("bundled", tensor_parallel_size=2, **_options()) as tp2:
        # 9 heads and 3 KV heads over 2 ranks: rank 0 holds 2 KV-head groups, rank 1 one.
        assert tp2.engine.model.layout.num_kv_heads == 2
        assert tp2.engine.runner.kv_caches[0][0].shape[2] == 2  # only its heads' KV cache
        tokens2, logits2 = _run(tp2)
    # Under tensor parallelism the GGUF loads dequantized: one rank compares with the same.
    tokens1, logits1 = _run(LLM("bundled", quantization="none", **_options()))
    assert tokens2 == tokens1
    assert len(logits2) == len(logits1) == GREEDY.max_tokens
    diff = max((a - b).abs().max().item() for a, b in zip(logits1, logits2, strict=True))
    print(f"bundled float32, TP=2 vs TP=1: max |logit difference| = {diff:.3g}")
    assert diff < LOGIT_ATOL


@pytest.mark.parametrize(("fixture", "size"), [("tiny_qwen2_dir", 2), ("tiny_llama_dir", 4)])
def test_biases_untied_heads_and_replicated_kv_heads_shard_exactly(
    request: pytest.FixtureRequest, fixture: str, size: int
) -> None:
    """Qwen2 (q/k/v biases, tied embeddings) over 2 ranks; Llama (untied LM head; 4 heads,
    2 KV heads) over 4 ranks, which replicates each KV head on 2 ranks. Prompt logprobs
    make every rank join the same chunked logits gathers as rank 0."""
    folder = str(request.getfixturevalue(fixture))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    with LLM(folder, tensor_parallel_size=size, **_options()) as tp:
        sharded = tp.generate(PROMPTS, params)
    whole = LLM(folder, **_options()).generate(PROMPTS, params)
    for s, w in zip(sharded, whole, strict=True):
        assert s.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(s.prompt_logprobs) == len(w.prompt_logprobs) > 0
        for a, b in zip(s.prompt_logprobs, w.prompt_logprobs, strict=True):
            if a is None:
                continue
            assert a.token_id == b.token_id
            assert abs(a.logprob - b.logprob) < LOGIT_ATOL


def test_a_size_the_heads_cannot_take_is_refused_before_any_process_starts() -> None:
    with pytest.raises(TensorParallelError, match="9 attention heads and 3 KV heads"):
        LLM("bundled", tensor_parallel_size=4, **_options())


def test_a_killed_rank_makes_the_next_generate_raise_naming_it(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **_options())
    try:
        assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids
        (pid,) = llm.engine.workers.pids()
        os.kill(pid, signal.SIGKILL)
        llm.engine.workers.procs[0].join(10)
        start = time.monotonic()
        with pytest.raises(TPWorkerError, match=rf"rank 1 \(pid {pid}\) exited with code -9"):
            llm.generate(PROMPTS[0], GREEDY)
        assert time.monotonic() - start < 5
    finally:
        llm.close()


def test_serve_with_a_killed_rank_fails_its_health_check_and_exits_1(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from server_fixtures import request, start_server

    server = start_server(tiny_llama_dir, tmp_path, "--tensor-parallel-size", "2")
    try:
        server.wait_healthy()
        body = {"model": server_model(server), "prompt": "Hello", "max_tokens": 4}
        assert request(server.port, "POST", "/v1/completions", body).status == 200
        match = re.search(r"tensor-parallel rank 1 started \(pid (\d+)\)", server.log())
        assert match, server.log()
        os.kill(int(match.group(1)), signal.SIGKILL)
        killed = time.monotonic()
        statuses = []
        while time.monotonic() - killed < 10:
            try:
                statuses.append(request(server.port, "GET", "/health", timeout=2).status)
            except OSError:
                statuses.append(None)  # the server has exited: even less healthy
            if statuses[-1] != 200:
                break
            time.sleep(0.1)
        assert statuses[-1] != 200, f"still healthy 10 s after the kill:\n{server.log()}"
        print(f"/health {statuses[-1]} {time.monotonic() - killed:.2f} s after the kill")
        assert server.proc.wait(30) == 1
        assert "tensor-parallel rank 1" in server.log() and "exited with code -9" in server.log()
    finally:
        server.terminate()


def server_model(server) -> str:
    from server_fixtures import request

    return request(server.port, "GET", "/v1/models").json()["data"][0]["id"]


def test_bench_tensor_parallel_reports_both_engines_and_the_same_tokens(tmp_path: Path) -> None:
    import json

    from kvfleet.runtime.cli import main

    out = tmp_path / "tp.json"
    argv = ["bench", "tensor-parallel", "--model", "random:tiny", "--dtype", "float32"]
    argv += ["--rounds", "2", "--num-prompts", "2", "--prompt-len", "16", "--new-tokens", "4"]
    argv += ["--kv-cache-memory", "64MiB", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["same_greedy_tokens"] is True
    assert result["tensor_parallel_size"] == 2 and len(result["rounds"]) == 2
    assert set(result["median"]) == {
        "tp1_prefill_s", "tp1_decode_ms", "tp2_prefill_s", "tp2_decode_ms"
    }  # fmt: skip
    assert all(v > 0 for v in result["median"].values())


def test_a_start_that_fails_after_the_workers_started_leaves_no_worker_behind(
    tiny_llama_dir: Path,
) -> None:
    import multiprocessing

    import torch.distributed as dist
    from kvfleet.runtime.engine.config import ConfigError

    before = {p.pid for p in multiprocessing.active_children()}
    # The KV budget is checked once every rank has loaded: too small for max_model_len.
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, **_options(kv_cache_memory="64KiB"))
    assert {p.pid for p in multiprocessing.active_children()} == before
    assert not dist.is_initialized()


def test_a_script_without_the_main_guard_is_told_what_to_add(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text(
        "from kvfleet.runtime import LLM\n"
        "LLM('random:tiny', dtype='float32', tensor_parallel_size=2, kv_cache_memory='64MiB', "
        "max_model_len=512)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "TPWorkerError: tensor-parallel rank 1" in done.stderr
    assert "if __name__ == '__main__':" in done.stderr.splitlines()[-1]


def test_serve_stops_its_workers_on_sigterm(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from server_fixtures import start_server

    server = start_server(tiny_llama_dir, tmp_path, "--tensor-parallel-size", "2")
    try:
        server.wait_healthy()
        pid = int(re.search(r"rank 1 started \(pid (\d+)\)", server.log()).group(1))
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.log()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} outlived the server"
    finally:
        server.terminate()

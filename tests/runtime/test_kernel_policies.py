"""A kernel policy is chosen once and passed down: the engine builds its model with the policy its
config holds (flags included), tensor-parallel workers get the same one, and two models or
engines with different policies in one process route their ops independently, in turns."""

from __future__ import annotations

import argparse
import pickle

import pytest
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_decode_step, cpu_gemm, cpu_gemm_f32
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy
from kvfleet.runtime.engine import tp_start
from kvfleet.runtime.engine.config import ConfigError, EngineConfig
from kvfleet.runtime.engine.engine_args import add_engine_args, engine_config_from_args
from kvfleet.runtime.engine.llm import LLM
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.models.loader import load_model
from paged_decoder import Decoder


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.delenv("KVFLEET_CPU_KERNELS", raising=False)


def _config(*flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(flags)))


def test_engine_flags_make_the_kernel_policy():
    assert _config().kernel_policy == DEFAULT_POLICY
    policy = _config("--kernel-backend", "triton", "--no-allow-amx").kernel_policy
    assert policy == KernelPolicy(backend="triton", allow_amx=False)
    with pytest.raises(SystemExit):  # argparse names the choices
        _config("--kernel-backend", "cuda")


def test_a_config_holds_a_policy_or_is_refused_by_name():
    assert EngineConfig(kernel_policy=KernelPolicy(one_call_max_rows=0)).kernel_policy == (
        KernelPolicy(one_call_max_rows=0)
    )
    with pytest.raises(ConfigError, match="kernel_policy: must be a KernelPolicy, got dict"):
        EngineConfig(kernel_policy={"backend": "torch"})  # type: ignore[arg-type]


def test_the_engines_model_and_runner_run_the_configs_policy(tiny_llama_dir):
    policy = KernelPolicy(backend="torch", one_call_max_rows=0)
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, kernel_policy=policy)
    assert llm.engine.model.kernels.policy is policy
    assert llm.engine.runner.one_call is None  # its one-call rows are 0


def test_tensor_parallel_workers_are_given_the_engines_policy(monkeypatch):
    """What each worker process receives at spawn (its pickled WorkerSpec) holds rank 0's
    policy."""
    specs = []

    class Capture:
        def __init__(self, spec):
            specs.append(spec)
            raise RuntimeError("captured before any process started")

    monkeypatch.setattr(tp_start, "TPWorkers", Capture)
    policy = KernelPolicy(f32_gemm_max_rows=7, one_call_max_rows=0)
    with pytest.raises(RuntimeError, match="captured"):
        LLM(
            "random:tiny", dtype="float32", tensor_parallel_size=2, kv_cache_memory="64MiB",
            kernel_policy=policy,
        )  # fmt: skip
    (spec,) = specs
    assert spec.kernel_policy == policy
    assert pickle.loads(pickle.dumps(spec)).kernel_policy == policy


def test_two_models_with_different_policies_route_independently(tiny_llama_dir, monkeypatch):
    """The same weights under the default policy and under one with kvfleet's float32 GEMM off,
    stepping in turns on the same cache bytes: only the first ever calls the kernel (per op or
    inside the fused step), and each reports its own path."""
    if not cpu_gemm_f32.available():
        pytest.skip("no AVX-512 or AVX2 here: both models would run torch's GEMM")
    calls: list[str] = []
    linear, stack_run = cpu_gemm_f32.linear, cpu_decode_step.DecodeStack.run
    monkeypatch.setattr(cpu_gemm_f32, "linear", lambda *a: calls.append("linear") or linear(*a))
    monkeypatch.setattr(
        cpu_decode_step.DecodeStack, "run", lambda *a: calls.append("fused") or stack_run(*a)
    )
    ours, _, _ = load_model(str(tiny_llama_dir), torch.float32, "cpu")
    theirs, _, _ = load_model(
        str(tiny_llama_dir), torch.float32, "cpu", policy=KernelPolicy(f32_gemm_max_rows=0)
    )
    ours.prepack()
    theirs.prepack()
    a = Decoder(ours, [5, 9, 3])  # a prefill step, in the fused call on the kernel
    assert calls == ["fused"]
    b = a.fork(theirs)
    for _ in range(3):
        calls.clear()
        got = b.decode()
        assert calls == []  # torch's GEMM, op by op
        want = a.decode()
        assert calls == ["fused"]  # the fused step, on the kernel
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # summation order only
    weight = ours.layers[0].qkv_proj
    assert ours.kernels.linear_path(weight, 3) != dispatch.PATH_TORCH
    assert theirs.kernels.linear_path(weight, 3) == dispatch.PATH_TORCH


def test_two_engines_with_different_policies_take_turns(tiny_llama_dir, one_calls):
    """An engine whose policy keeps the one-call decode step and one whose policy turns it off,
    generating in turns in one process: the one call runs for the first only, and both give the
    same tokens (the two paths give the same bits)."""
    dtype = "bfloat16" if cpu_gemm.available() else "float32"
    if dtype == "float32" and not cpu_gemm_f32.available():
        pytest.skip("no C GEMM here: the fused steps need one")
    options = dict(dtype=dtype, max_model_len=128, max_num_seqs=4)
    one = LLM(str(tiny_llama_dir), **options)
    two = LLM(str(tiny_llama_dir), kernel_policy=KernelPolicy(one_call_max_rows=0), **options)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for prompt in ([11, 12, 13, 14, 15], [21, 22, 23]):
        before = len(one_calls)
        want = two.generate([prompt, prompt[::-1]], params)
        assert len(one_calls) == before
        got = one.generate([prompt, prompt[::-1]], params)
        assert len(one_calls) > before
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_a_model_swaps_its_policy_only_within_its_backend(tiny_llama_dir):
    net, _, _ = load_model(str(tiny_llama_dir), torch.float32, "cpu")
    previous = net.use_kernel_policy(KernelPolicy(f32_gemm_max_rows=0))
    assert previous is DEFAULT_POLICY and net.kernels.policy.f32_gemm_max_rows == 0
    with pytest.raises(ValueError, match="backend: 'triton' differs from the model's 'auto'"):
        net.use_kernel_policy(KernelPolicy(backend="triton"))
    assert net.use_kernel_policy(previous).f32_gemm_max_rows == 0
    assert net.kernels.policy is DEFAULT_POLICY

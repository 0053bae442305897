"""vLLM's flags pasted into `kvfleet serve`: --gpu-memory-utilization with vLLM's meaning, the
flags that change nothing here accepted, and every other one a start-up error (exit 2) whose
last stderr line names the flag."""

from __future__ import annotations

import argparse
import logging

import pytest
from kvfleet.runtime import cli
from kvfleet.runtime.engine.config import ConfigError, EngineConfig
from kvfleet.runtime.engine.kv_budget import GIB, gpu_kv_budget
from kvfleet.runtime.server import cmd_serve
from kvfleet.runtime.server.vllm_flags import NO_OP_FLAGS, UNSUPPORTED_FLAGS


def serve_exit(capsys, *flags: str) -> tuple[int, str]:
    """`kvfleet serve <flags>`'s exit code and the last line it wrote to stderr."""
    code = cli.main(["serve", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cmd_serve.register(parser.add_subparsers())
    return parser


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--swap-space", "16"], "--swap-space"),
        (["--pipeline-parallel-size=2"], "--pipeline-parallel-size"),
        (["--cpu-offload-gb", "10"], "--cpu-offload-gb"),
        (["-O3"], "-O"),
        (["--compilation-config", '{"level": 3}'], "--compilation-config"),
        (["--enable-expert-parallel"], "--enable-expert-parallel"),
    ],
)
def test_an_unsupported_vllm_flag_is_a_start_up_error_naming_it(capsys, flags, named):
    code, last = serve_exit(capsys, "--model", "random:tiny", *flags)
    assert code == 2
    assert last.startswith(f"kvfleet serve: error: {named}")
    assert "kvfleet does not support this vLLM flag" in last


def test_every_unsupported_flag_given_is_named_in_one_line(capsys):
    code, last = serve_exit(capsys, "--swap-space", "4", "--trust-remote-code", "-pp", "2")
    assert code == 2
    assert last == (
        "kvfleet serve: error: --swap-space (preempted requests are recomputed, never swapped); "
        "-pp (use --tensor-parallel-size): kvfleet does not support these vLLM flags; remove "
        "them from the command line"
    )


def test_each_listed_flag_reaches_the_check_and_none_is_a_kvfleet_flag(capsys):
    """A flag kvfleet comes to support must leave the lists: its own option would win, and the
    lists would promise an error or a no-op that no longer happens."""
    parser = serve_parser()
    for flag in (*UNSUPPORTED_FLAGS, *NO_OP_FLAGS):
        action = parser._subparsers._group_actions[0].choices["serve"]._option_string_actions[flag]
        assert action.dest == "vllm_flags_given", f"{flag} is a kvfleet flag"
    for flag in UNSUPPORTED_FLAGS:
        code, last = serve_exit(capsys, flag, "1")
        assert code == 2 and f"{flag}" in last and "kvfleet does not support" in last, flag


def test_no_op_flags_are_accepted_and_logged(caplog):
    args = serve_parser().parse_args(
        ["serve", "--disable-log-requests", "--trust-remote-code", "--model", "random:tiny"]
    )
    assert args.model == "random:tiny"  # no flag swallowed the next one
    with caplog.at_level(logging.INFO, logger="kvfleet.serve"):
        cmd_serve._check_serve_args(args)
    logged = caplog.text
    assert "--disable-log-requests: kvfleet does not log requests" in logged
    assert "--trust-remote-code: kvfleet runs its own model code" in logged


def test_a_parse_starts_with_no_flags_recorded():
    parser = serve_parser()
    parser.parse_args(["serve", "--swap-space", "4"])
    assert parser.parse_args(["serve"]).vllm_flags_given == ()


def test_gpu_memory_utilization_is_a_share_of_the_total_less_what_is_in_use():
    # 80 GiB GPU, 17 GiB in use after loading (weights + CUDA context): 0.9 * 80 - 17 = 55 GiB.
    assert gpu_kv_budget(63 * GIB, 80 * GIB, 0.9, 0.9) == int(0.9 * 80 * GIB) - 17 * GIB
    # Without it the fraction applies to what is free, as before.
    assert gpu_kv_budget(63 * GIB, 80 * GIB, 0.5, None) == int(31.5 * GIB)
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization: 0.2 of the GPU's 80.0 GiB"):
        gpu_kv_budget(63 * GIB, 80 * GIB, 0.9, 0.2)


def test_gpu_memory_utilization_refuses_a_second_budget_and_out_of_range(capsys):
    with pytest.raises(ConfigError, match="gpu_memory_utilization: give it or kv_cache_memory,"):
        EngineConfig(gpu_memory_utilization=0.8, kv_cache_memory="1GiB")
    with pytest.raises(ConfigError, match="give it or kv_cache_memory_fraction, not both"):
        EngineConfig(gpu_memory_utilization=0.8, kv_cache_memory_fraction=0.5)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match=r"gpu_memory_utilization: must be in \(0, 1\]"):
            EngineConfig(gpu_memory_utilization=bad)
    code, last = serve_exit(capsys, "--gpu-memory-utilization", "0.9", "--kv-cache-memory", "2GiB")
    assert code == 2 and "gpu_memory_utilization: give it or kv_cache_memory" in last
    # On CPU the flag is accepted and the CPU's own budget stands.
    assert EngineConfig(device="cpu", gpu_memory_utilization=0.9).kv_cache_memory is None


def test_a_one_process_gpu_core_sizes_its_cache_by_gpu_memory_utilization(monkeypatch):
    import torch
    from kvfleet.runtime.engine.core import EngineCore

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (63 * GIB, 80 * GIB))
    core = EngineCore.__new__(EngineCore)
    core.config = EngineConfig(gpu_memory_utilization=0.9)
    core.device = torch.device("cuda", 0)
    assert core._kv_budget() == int(0.9 * 80 * GIB) - 17 * GIB

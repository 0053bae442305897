"""`kvfleet doctor` on this CPU machine: what it reports, and the one last line it ends with
when something serving needs is missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kvfleet.runtime import cli, cmd_doctor
from kvfleet.runtime.cmd_doctor import FAIL, OK, WARN, Finding, driver_problem, verdict


def doctor(capsys, *args: str) -> tuple[int, list[str], str]:
    code = cli.main(["doctor", *args])
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err.strip()


def test_on_cpu_it_reports_versions_compiler_triton_and_the_cpu_kernels_isa(capsys):
    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1"  # the test run's setting (Makefile)
    code, lines, err = doctor(capsys)
    assert code == 0 and err == ""
    by_name = {line.split(":", 1)[0].split(None, 1)[1]: line for line in lines[:-1]}
    assert by_name["torch"].startswith("ok") and torch.__version__ in by_name["torch"]
    assert by_name["cuda"].startswith("info") and "serving on CPU" in by_name["cuda"]
    assert by_name["c compiler"].startswith("ok") and "gcc" in by_name["c compiler"]
    # Under TRITON_INTERPRET=1 the kernel really runs, interpreted, and is compared.
    assert "silu_and_mul interpreted (TRITON_INTERPRET=1) on cpu" in by_name["triton kernel"]
    assert by_name["cpu kernels"].startswith("ok  ") and "built for " in by_name["cpu kernels"]
    assert lines[-1] == "kvfleet doctor: ok: this machine can serve"


def test_asking_for_a_gpu_on_a_machine_without_one_fails_with_one_last_line(capsys):
    code, lines, err = doctor(capsys, "--device", "cuda")
    assert code == 1
    assert err.startswith("kvfleet doctor: error: cuda: no CUDA device is visible")
    assert any(line.startswith("info  triton kernel: not run") for line in lines)


def test_without_a_compiler_a_gpu_fails_and_a_cpu_warns(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    gpu = cmd_doctor.compiler_finding(gpu=True)
    assert gpu.status == FAIL and "Triton needs one" in gpu.detail
    cpu = cmd_doctor.compiler_finding(gpu=False)
    assert cpu.status == WARN and "torch reference" in cpu.detail


def test_without_torch_it_stops_at_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from kvfleet.runtime.cli import main\n"
        "sys.exit(main(['doctor']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("kvfleet doctor: error: torch: not importable")
    )
    assert "cpu kernels" not in done.stdout


@pytest.mark.parametrize(
    "torch_cuda,driver,problem",
    [
        ("13.0", "13.0", None),
        ("13.0", "13.1", None),
        ("12.8", "13.0", None),
        ("13.0", "12.8", "the driver supports CUDA 12.8, older than torch's CUDA 13.0 build"),
        ("13.0", None, "no NVIDIA driver found"),
        (None, None, None),  # a CPU build needs no driver
    ],
)
def test_a_driver_older_than_torchs_cuda_build_is_named(torch_cuda, driver, problem):
    found = driver_problem(torch_cuda, driver)
    assert (found is None) if problem is None else (problem in found)


def test_the_last_line_is_the_first_failure_or_a_summary():
    ok = Finding("python", OK, "3.11.7")
    warned = Finding("c compiler", WARN, "none found")
    failed = Finding("triton", FAIL, "not installed; the GPU kernels are Triton kernels")
    assert verdict([ok, warned]) == (True, "ok: this machine can serve (1 warning above)")
    assert verdict([ok, failed, Finding("x", FAIL, "later")]) == (
        False,
        "error: triton: not installed; the GPU kernels are Triton kernels",
    )


def test_a_cpu_kernel_build_failure_is_a_warning_naming_the_compilers_error(monkeypatch, tmp_path):
    from kvfleet.kernels.cpu import cpu_library

    broken = tmp_path / "gcc"
    broken.write_text("#!/bin/sh\necho 'cc1: error: bad flag' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(cpu_library, "COMPILER", [str(broken)])
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path / "cache"))
    finding = cmd_doctor._cpu_kernels()
    assert finding.status == WARN
    assert finding.detail == "build failed, torch reference runs: cc1: error: bad flag"


def test_serve_on_a_gpu_without_a_compiler_stops_before_loading_with_one_line(
    capsys, monkeypatch, tmp_path
):
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no cc
    code = cli.main(["serve", "--device", "cuda", "--model", "random:tiny"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1
    assert last == (
        "kvfleet serve: error: cannot serve on cuda: c compiler: none found (gcc or cc); "
        "Triton needs one to launch kernels (`kvfleet doctor` reports the whole machine)"
    )


def test_serves_start_up_check_is_quiet_where_nothing_is_missing(monkeypatch, tmp_path):
    import torch

    assert cmd_doctor.serving_problem("cpu", "auto") is None
    assert cmd_doctor.serving_problem("auto", "auto") is None  # no GPU here: the CPU serves
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # Without a driver, auto is the CPU before torch is asked (and imported) at all.
    monkeypatch.setattr(cmd_doctor, "cuda_driver_version", lambda: None)
    assert cmd_doctor.serving_problem("auto", "auto") is None
    monkeypatch.setattr(cmd_doctor, "cuda_driver_version", lambda: "13.0")
    assert "c compiler: none found" in cmd_doctor.serving_problem("auto", "auto")
    # The torch backend launches no Triton kernel: no compiler needed.
    assert cmd_doctor.serving_problem("cuda", "torch") is None
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cmd_doctor, "cuda_driver_version", lambda: "12.8")
    assert cmd_doctor.serving_problem("cuda", "torch").startswith(
        "driver: the driver supports CUDA 12.8, older than torch's CUDA 13.0 build"
    )

"""The CPU runtime image's install steps, run for real: docker/install-runtime.sh in a fresh
venv (from the files the image copies), then `kvfleet serve` from that venv answers /health.
What the image gets is what this test ran; only the torch wheel's index differs (the image
names PyTorch's CPU index, here pip's configuration finds the same CPU build)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What runtime-cpu.Dockerfile copies into /src before running the script.
IMAGE_SOURCES = ("pyproject.toml", "README.md", "kvfleet", "runtime", "kernels", "operator",
                 "devcluster", "docker/install-runtime.sh")  # fmt: skip
# The CPU build on this machine; another spelling would pull a CUDA build of several GB.
TORCH = "torch==2.13.0"


def pypi_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
    except (urllib.error.URLError, OSError):
        return False
    return True


pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(not pypi_reachable(), reason="PyPI is unreachable: pip cannot install"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_image_sources(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for name in IMAGE_SOURCES:
        source, target = ROOT / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=ignore)
        else:
            shutil.copy2(source, target)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    status = 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            status = exc.code  # 503 while the model loads
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return status


def complete_to_schema(base: str) -> object:
    """The JSON object a completion held to a one-boolean schema returns (a random model's
    every token is masked to it, and a boolean ends within a few tokens)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    body = {"model": "random:tiny", "prompt": "ok:", "max_tokens": 32, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "ok", "schema": schema}}}  # fmt: skip
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(json.loads(response.read())["choices"][0]["text"])


@pytest.fixture
def venv_dir() -> Iterator[Path]:
    """A folder for the venv, removed when the test ends (pytest would keep the last runs'
    temporary folders, 2.5 GB of venv each): in memory where there is room, as removing that
    many files from a disk takes minutes."""
    memory = Path("/dev/shm")
    room = memory.is_dir() and shutil.disk_usage(memory).free > 8 * 1024**3
    with tempfile.TemporaryDirectory(dir=memory if room else None, prefix="kvfleet-") as folder:
        yield Path(folder)


def test_the_cpu_images_install_steps_give_a_venv_that_serves(tmp_path, venv_dir):
    src, venv = tmp_path / "src", venv_dir / "venv"
    copy_image_sources(src)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {
        **os.environ,
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": str(venv / "bin" / "python"),
    }
    env.pop("TORCH_INDEX_URL", None)
    # Byte-compiling torch's files costs ~25 s of this test and proves nothing here. Spelled
    # PIP_COMPILE=0: pip reads PIP_NO_COMPILE=1 as --no-compile's value "true", i.e. compile.
    env.pop("PIP_NO_COMPILE", None)
    env["PIP_COMPILE"] = "0"
    done = subprocess.run(
        ["sh", str(src / "docker/install-runtime.sh"), "cpu", TORCH, str(src)],
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    compiled = next((venv / "lib").glob("python3*/site-packages/torch/**/*.pyc"), None)
    assert compiled is None, f"pip byte-compiled torch ({compiled}): the install took longer"

    port = free_port()
    serve_env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [str(venv / "bin" / "kvfleet"), "serve", "--model", "random:tiny", "--host",
         "127.0.0.1", "--port", str(port), "--kv-cache-memory", "64MiB"],
        env=serve_env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        status = wait_healthy(f"http://127.0.0.1:{port}/health", proc, timeout=120)
        # Structured outputs work in an image without Triton: xgrammar masks on the CPU.
        answer = complete_to_schema(f"http://127.0.0.1:{port}") if status == 200 else None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    served = (tmp_path / "serve.log").read_text()
    assert status == 200, served[-3000:]
    assert isinstance(answer, dict) and set(answer) == {"ok"} and answer["ok"] in (True, False)
    # The venv's own kvfleet served, not the checkout's, and no Triton came with it (1 GB).
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.util, kvfleet, torch; print("
         "kvfleet.__file__, torch.__version__, importlib.util.find_spec('triton'))"],
        env=serve_env, cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert str(venv) in site and "2.13.0" in site and site.rstrip().endswith("None"), site

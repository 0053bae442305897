"""Models from the Hugging Face Hub, as a user runs them: `kvfleet download` / `--model org/name`
against a fake Hub on 127.0.0.1 (tests/fake_hub.py) through the real huggingface_hub client —
first download, the cache alone once the Hub is gone, revisions, gated repos, missing files,
an interrupted download that resumes, and only the files the runtime reads."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_hub import fake_hub
from kvfleet.runtime.models import hub as hub_module
from kvfleet.runtime.models.errors import ModelLoadError
from server_fixtures import request, running_server

TOKEN = "hf_test_token"
PROMPT = ["--prompt", "The capital of France is", "--max-tokens", "6"]


def kvfleet(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvfleet.runtime.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def repos(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Hub repos as folders: the tiny model as published (plus files the runtime must not
    fetch), a sharded copy with a decoy consolidated checkpoint, a revision whose generation
    differs, and repos broken in the ways published ones are."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hub-repos")
    plain = root / "plain"
    shutil.copytree(tiny_llama_dir, plain)
    (plain / "README.md").write_text("# a model card the runtime never reads\n")
    (plain / "pytorch_model.bin").write_bytes(b"\0" * 1024)  # an old-format duplicate

    sharded = root / "sharded"
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    hf.save_pretrained(str(sharded), max_shard_size="2MB")
    for f in tiny_llama_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, sharded)
    shutil.copy(tiny_llama_dir / "model.safetensors", sharded / "consolidated.safetensors")

    other = root / "v2"
    shutil.copytree(tiny_llama_dir, other)
    cfg = json.loads((other / "generation_config.json").read_text())
    (other / "generation_config.json").write_text(json.dumps({**cfg, "marker": "v2"}))

    missing_shard = root / "missing-shard"
    shutil.copytree(sharded, missing_shard)
    next(missing_shard.glob("model-0000*.safetensors")).unlink()

    bin_only = root / "bin-only"
    bin_only.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", bin_only)
    (bin_only / "pytorch_model.bin").write_bytes(b"\0" * 64)
    return {
        "org/tiny": plain,
        "org/sharded": sharded,
        "org/v2": other,
        "org/missing-shard": missing_shard,
        "org/bin-only": bin_only,
    }


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    e["HF_HOME"] = str(tmp_path / "hf-home")
    return e


@pytest.fixture
def hub(repos: dict[str, Path], env: dict[str, str]) -> Iterator:
    served = {
        **{k: v for k, v in repos.items() if k != "org/v2"},
        "org/revs": {"main": repos["org/tiny"], "v2": repos["org/v2"]},
        "org/gated": repos["org/tiny"],
    }
    with fake_hub(served, gated={"org/gated"}, token=TOKEN) as h:
        env["HF_ENDPOINT"] = h.url
        yield h


def snapshot_files(folder: str) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file()}


def test_generate_from_a_hub_id_then_from_the_cache_with_the_hub_gone(hub, env) -> None:
    first = kvfleet("generate", "--model", "org/tiny", *PROMPT, env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip()
    asked = len(hub.requests)

    offline = {**env, "HF_HUB_OFFLINE": "1"}
    again = kvfleet("generate", "--model", "org/tiny", *PROMPT, env=offline)
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout  # greedy: the same weights give the same text
    assert len(hub.requests) == asked  # not one request reached the Hub
    # Without HF_HUB_OFFLINE, a Hub that cannot be reached also falls back to the cache.
    unreachable = {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}
    third = kvfleet("generate", "--model", "org/tiny", *PROMPT, env=unreachable)
    assert third.returncode == 0, third.stderr
    assert third.stdout == first.stdout


def test_serve_answers_under_the_hub_id_as_vllm_does(hub, env, tmp_path) -> None:
    with running_server("org/tiny", tmp_path, env=env) as server:
        models = request(server.port, "GET", "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["org/tiny"]
        body = {"model": "org/tiny", "prompt": "Hello", "max_tokens": 2}
        assert request(server.port, "POST", "/v1/completions", body).status == 200


def test_download_fetches_only_what_the_runtime_reads(hub, env) -> None:
    done = kvfleet("download", "--model", "org/tiny", env=env)
    assert done.returncode == 0, done.stderr
    files = snapshot_files(done.stdout.strip())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert "README.md" not in files and "pytorch_model.bin" not in files

    sharded = kvfleet("download", "--model", "org/sharded", env=env)
    assert sharded.returncode == 0, sharded.stderr
    files = snapshot_files(sharded.stdout.strip())
    index = json.loads((Path(sharded.stdout.strip()) / hub_module.INDEX).read_text())
    assert set(index["weight_map"].values()) <= files
    assert "consolidated.safetensors" not in files  # the same weights again: not fetched
    answered = kvfleet("generate", "--model", "org/sharded", *PROMPT, env=env)
    assert answered.returncode == 0, answered.stderr


def test_a_revision_is_fetched_and_found_again_offline(hub, env) -> None:
    v2 = kvfleet("download", "--model", "org/revs", "--revision", "v2", env=env)
    main = kvfleet("download", "--model", "org/revs", env=env)
    assert v2.returncode == 0 and main.returncode == 0, v2.stderr + main.stderr
    assert v2.stdout != main.stdout
    marker = json.loads((Path(v2.stdout.strip()) / "generation_config.json").read_text())
    assert marker["marker"] == "v2"
    assert Path(v2.stdout.strip()).name == hub.commit("org/revs", "v2")
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    cached = kvfleet("download", "--model", "org/revs", "--revision", "v2", env=offline)
    assert cached.returncode == 0 and cached.stdout == v2.stdout, cached.stderr
    by_commit = kvfleet(
        "download", "--model", "org/revs", "--revision", hub.commit("org/revs", "v2"), env=env
    )
    assert by_commit.stdout == v2.stdout, by_commit.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["org/nothing"], ["'org/nothing' is not on the Hugging Face Hub", "HF_TOKEN"]),
        (["org/gated"], ["is gated", "accept its terms", "HF_TOKEN", "hfTokenSecretRef"]),
        (["org/revs", "--revision", "v9"], ["no such revision", "'v9'"]),
        (["org/missing-shard"], ["names shards the repo lacks"]),
        (["org/bin-only"], ["no *.safetensors", "pytorch_model.bin"]),
    ],
)
def test_hub_failures_name_the_model_and_what_to_do(hub, env, args, words) -> None:
    result = kvfleet("download", "--model", *args, env=env)
    assert result.returncode == 2
    for w in words:
        assert w in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_gated_model_downloads_with_a_token(hub, env) -> None:
    with_env = kvfleet("download", "--model", "org/gated", env={**env, "HF_TOKEN": TOKEN})
    assert with_env.returncode == 0, with_env.stderr
    with_flag = kvfleet("download", "--model", "org/gated", "--hf-token", TOKEN, env=env)
    assert with_flag.returncode == 0, with_flag.stderr


def test_offline_without_the_files_says_to_download_first(env) -> None:
    result = kvfleet("generate", "--model", "org/tiny", *PROMPT, env={**env, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    assert "not in the Hugging Face cache" in result.stderr
    assert "kvfleet download --model org/tiny" in result.stderr


def test_an_interrupted_download_resumes_where_it_stopped(hub, env, repos) -> None:
    weights = repos["org/tiny"] / "model.safetensors"
    # Past huggingface_hub's first 10 MB chunk, so that some of the file is on disk when the
    # connection drops.
    cut = weights.stat().st_size * 2 // 3
    assert cut > 10 * 1024 * 1024
    hub.cut_after["model.safetensors"] = cut
    result = kvfleet("download", "--model", "org/tiny", env=env)
    if result.returncode != 0:  # the client gave up after the cut: the next run resumes
        result = kvfleet("download", "--model", "org/tiny", env=env)
    assert result.returncode == 0, result.stderr
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("/model.safetensors")]
    assert ranges[0] is None  # the first, full request: cut
    starts = [int(r[len("bytes=") :].split("-")[0]) for r in ranges[1:] if r]
    assert starts and 0 < starts[0] <= cut, ranges  # then only the rest was asked for
    got = Path(result.stdout.strip()) / "model.safetensors"
    assert got.read_bytes() == weights.read_bytes()


def test_too_little_disk_is_refused_before_downloading(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(hub_module.shutil, "disk_usage", lambda _: usage._replace(free=3 * 10**9))
    with pytest.raises(ModelLoadError, match=r"needs 16\.00 GB .* 3\.00 GB free.*sizeHint"):
        hub_module._check_room("org/big", {"model.safetensors": 16 * 10**9})


def test_a_cache_volume_smaller_than_its_disk_is_respected(monkeypatch, tmp_path) -> None:
    # A pod's emptyDir reports the node's free disk; the operator passes its sizeLimit.
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("KVFLEET_CACHE_LIMIT_BYTES", str(2 * 10**9))
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "other-model.bin").write_bytes(b"\0" * 10**6)
    with pytest.raises(ModelLoadError, match=r"needs 3\.00 GB .* 2\.00 GB free"):
        hub_module._check_room("org/big", {"model.safetensors": 3 * 10**9})
    hub_module._check_room("org/small", {"model.safetensors": 10**9})  # fits: no error


def test_without_a_terminal_progress_goes_to_the_log(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr(hub_module, "PROGRESS_EVERY_S", 0.05)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    blobs = tmp_path / "hub" / "models--org--big" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "abc.incomplete").write_bytes(b"\0" * 500_000)
    import time

    with (
        caplog.at_level(logging.INFO, logger=hub_module.__name__),
        hub_module._progress("org/big", 1_000_000),
    ):
        time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records if "downloading org/big" in r.getMessage()]
    assert lines and "0.00 of 0.00 GB (50%" in lines[-1]


@pytest.mark.parametrize(
    ("model", "is_hub"),
    [("org/name", True), ("meta-llama/Llama-3.1-8B-Instruct", True), ("bundled", False),
     ("./org/name", False), ("/abs/path", False), ("a/b/c", False), ("x.gguf", False)],
)  # fmt: skip
def test_what_reads_as_a_hub_id(model, is_hub) -> None:
    assert hub_module.is_hub_id(model) is is_hub

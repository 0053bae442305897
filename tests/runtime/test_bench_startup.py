"""`kvfleet bench startup`: launch to ready, to a first token and SIGTERM to exit, in turns with
a baseline server command, the ratios taken pair by pair; bad flags and a baseline that dies
are named."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from kvfleet.runtime.cli import main

TINY = ["--model", "random:tiny", "--kv-cache-memory", "64MiB", "--num-threads", "1"]


def test_times_kvfleet_and_a_baseline_in_turns(tmp_path, capsys) -> None:
    baseline = shlex.join(
        [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--host", "127.0.0.1",
         "--port", "{port}", *TINY, "--max-num-seqs", "8"]
    )  # fmt: skip
    out = tmp_path / "startup.json"
    code = main(["bench", "startup", *TINY, "--runs", "1", "--baseline-cmd", baseline,
                 "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err[-3000:]
    result = json.loads(out.read_text())
    assert result["model"] == "random:tiny"
    for runs in (result["runs"], result["baseline_runs"]):
        (run,) = runs
        assert 0 < run["ready_s"] <= run["first_token_s"] < run["ready_s"] + 30
        assert 0 <= run["stop_s"] < 30
    ours, theirs = result["runs"][0], result["baseline_runs"][0]
    for name in ("ready_s", "first_token_s", "stop_s"):
        assert result[f"{name}_median"] == ours[name]
        assert result[f"baseline_{name}_median"] == theirs[name]
        if theirs[name] > 0:
            assert result[f"{name}_ratio_median"] == pytest.approx(ours[name] / theirs[name])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--runs", "0"], "--runs must be >= 1, got 0"),
        (["--baseline-cmd", "vllm serve m"], "--baseline-cmd must contain {port}"),
    ],
)
def test_bad_flags_are_named(flags, message, capsys) -> None:
    assert main(["bench", "startup", *TINY, *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_baseline_that_dies_is_named_with_its_log(capsys) -> None:
    dies = (
        f"{shlex.quote(sys.executable)} -c 'print(\"no such model\"); raise SystemExit(3)' {{port}}"
    )
    assert main(["bench", "startup", "--model", "random:tiny", "--runs", "1",
                 "--baseline-cmd", dies, "--serve-args", "--kv-cache-memory 64MiB"]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert "--baseline-cmd exited 3" in err and "no such model" in err

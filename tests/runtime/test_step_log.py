"""`--step-log FILE`: a line for every step the engine serves (not its warm-up), with the figures
the step-time model learns from; and `python -m kvfleet.runtime.bench.step_log_fit`, which fits
that model to a whole log."""

from __future__ import annotations

import argparse
import json
import random

import pytest
from kvfleet.runtime.bench import step_log_fit
from kvfleet.runtime.engine.config import ConfigError, EngineConfig
from kvfleet.runtime.engine.engine_args import add_engine_args, engine_config_from_args
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.engine.step_log import StepLog, read_step_log
from kvfleet.runtime.engine.step_time import context_sum
from test_step_time import Host


def test_every_served_step_is_logged_with_its_tokens(tiny_llama_dir, tmp_path):
    from kvfleet.runtime.engine.llm import LLM

    log = tmp_path / "steps.jsonl"
    prompts = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate((40, 9, 23))]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with LLM(
        str(tiny_llama_dir),
        dtype="float32",
        step_log=str(log),
        enable_prefix_caching=False,
        max_num_batched_tokens=32,  # the 40-token prompt takes two steps
    ) as llm:
        llm.engine.warm_up()
        assert log.read_text() == ""  # the warm-up's steps are not the run's
        llm.generate(prompts, params)
        served_steps = llm.engine.core.counters.steps
    steps = read_step_log(str(log))
    assert len(steps) == served_steps > 0
    assert sum(s["prompt_tokens"] for s in steps) == 40 + 9 + 23
    # Each sequence's first token comes with its prompt's last step; the other 4 decode.
    assert sum(s["decode_rows"] for s in steps) == 3 * 4
    assert all(s["seconds"] > 0 for s in steps)
    # The first step takes the 40-token prompt's first 32 tokens: their context, summed.
    assert (steps[0]["prompt_tokens"], steps[0]["context"]) == (32, context_sum(0, 32))
    times = [s["time"] for s in steps]
    assert times == sorted(times)


def test_a_path_that_cannot_be_written_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"step_log: cannot append to .*missing"):
        StepLog(str(tmp_path / "missing" / "steps.jsonl"))


def test_the_flag_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser, serving=True)
    args = parser.parse_args(["--step-log", "steps.jsonl"])
    assert engine_config_from_args(args).step_log == "steps.jsonl"
    assert EngineConfig().step_log is None


def _host_log(host: Host, path, steps: int = 400, seed: int = 0, then: float = 1000.0) -> None:
    """A log of `steps` steps as `host` times them, one a second from `then` on: decode-only
    steps of 1-32 rows and steps adding prompt chunks at starts up to 4096; appended to `path`
    with a torn last line, as a killed core may leave it."""
    rng = random.Random(seed)
    lines = []
    for i in range(steps):
        rows = rng.randint(1, 32)
        prompt = rng.choice([0, 0, rng.randint(16, 256)])
        context = context_sum(rng.randrange(0, 4096, 64), prompt) if prompt else 0
        seconds = host.step(prompt, rows, context)
        lines.append(
            {"time": then + i, "prompt_tokens": prompt, "decode_rows": rows,
             "seconds": seconds, "context": context}
        )  # fmt: skip
    with open(path, "a") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines) + '{"time": 10\n')


def test_the_fit_reads_a_hosts_costs_back_from_its_log(tmp_path):
    host = Host(fixed=0.0036, per_row=0.0019, switch=0.015, per_token=0.00085, per_context=5.9e-7)
    log = tmp_path / "steps.jsonl"
    _host_log(host, log)
    s = step_log_fit.summary(read_step_log(str(log)))  # the torn last line is left out
    assert s["steps"] == 400
    assert s["decode_only_steps"] + s["mixed_steps"] == 400
    for key, want in [
        ("decode_fixed_s", host.fixed),
        ("decode_per_row_s", host.per_row),
        ("prompt_fixed_s", host.switch),
        ("prompt_per_token_s", host.per_token),
        ("prompt_per_context_s", host.per_context),
    ]:
        assert s[key] == pytest.approx(want, rel=1e-3), key


def test_the_command_prints_the_fit_and_writes_json(tmp_path, capsys):
    host = Host(fixed=0.01, per_row=0.002, switch=0.005, per_token=0.001, per_context=1e-6)
    log, out = tmp_path / "steps.jsonl", tmp_path / "fit.json"
    _host_log(host, log)
    assert step_log_fit.main([str(log), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "decode-only step: 10.000 ms + 2.000 ms a row" in printed
    assert "prompt tokens add: 5.000 ms + 1.000 ms a token + 1.000 us a token of context" in printed
    assert json.loads(out.read_text())["prompt_per_token_s"] == pytest.approx(0.001, rel=1e-3)


def test_a_log_without_steps_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert step_log_fit.main([str(empty)]) == 1
    assert "no steps in" in capsys.readouterr().err


def test_runs_a_log_holds_are_fitted_apart_when_asked(tmp_path, capsys):
    """`bench serve`'s scenarios start a server per setting, each appending to the one log."""
    slow = Host(fixed=0.02, per_row=0.004, switch=0.01, per_token=0.002, per_context=2e-6)
    fast = Host(fixed=0.01, per_row=0.002, switch=0.005, per_token=0.001, per_context=1e-6)
    log, out = tmp_path / "steps.jsonl", tmp_path / "fits.json"
    _host_log(slow, log, steps=300, seed=1)
    _host_log(fast, log, steps=300, seed=2, then=2000.0)  # 700 s after the first run's end
    assert step_log_fit.main([str(log), "--split-at-gap", "60", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "run 1 of 2:" in printed and "run 2 of 2:" in printed
    first, second = json.loads(out.read_text())
    assert first["steps"] == second["steps"] == 300
    assert first["decode_per_row_s"] == pytest.approx(slow.per_row, rel=1e-3)
    assert second["decode_per_row_s"] == pytest.approx(fast.per_row, rel=1e-3)
    # Read as one run, the two hosts' steps blur into one fit that is neither.
    one = step_log_fit.summary(read_step_log(str(log)))
    assert one["steps"] == 600
    assert one["decode_per_row_s"] != pytest.approx(fast.per_row, rel=0.05)

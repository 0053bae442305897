"""`--step-log FILE`: one JSON line per engine step, the figures the step-time model learns from.

Each line is what `StepTimeModel.observe` takes — the step's prompt tokens, its decode rows, its
seconds (forward and sampling) and the context its prompt tokens attend to — with the wall-clock
time the step ended. `python -m kvfleet.runtime.bench.step_log_fit FILE` fits the model to a
whole log, so the per-row, per-token and per-context costs a host shows can be read again from
any run. The file is opened, appended to and closed every step (tens of microseconds, against
steps of milliseconds): a log is readable while the server runs, a killed core loses nothing it
wrote, and nothing holds the file open. The warm-up's steps are not logged.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kvfleet.runtime.engine.config import ConfigError

FIELDS = ("time", "prompt_tokens", "decode_rows", "seconds", "context")


class StepLog:
    """Appends each observed step to `path` (tried here: a path that cannot be written fails
    at start, naming the flag)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            open(path, "a", encoding="utf-8").close()
        except OSError as exc:
            raise ConfigError(f"step_log: cannot append to {path!r}: {exc.strerror}") from exc

    def observe(
        self, prompt_tokens: int, decode_rows: int, seconds: float, context: int = 0
    ) -> None:
        """`StepTimeModel.observe`'s figures for one step, written as one line."""
        line = {
            "time": round(time.time(), 6),
            "prompt_tokens": prompt_tokens,
            "decode_rows": decode_rows,
            "seconds": round(seconds, 7),
            "context": context,
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


def read_step_log(path: str) -> list[dict[str, Any]]:
    """The steps of a log, in order; a line that is not a step (a torn last line of a killed
    core) is skipped."""
    steps = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                step = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(step, dict) and all(k in step for k in FIELDS):
                steps.append(step)
    return steps

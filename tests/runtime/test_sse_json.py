"""The JSON of each streamed chunk: json.dumps writes what msgspec refuses, so that no chunk is
lost to its encoder (test_server_hardening reads the compact UTF-8 chunks themselves)."""

from __future__ import annotations

import json

import numpy as np
from kvfleet.runtime.server.generation import _json

CHUNK = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1732950000,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "text": " café ☕ 😀",
            "logprobs": {"token_logprobs": [-0.25, -9999.0], "tokens": ["a", "b"]},
            "finish_reason": None,
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}


def test_what_msgspec_refuses_is_written_by_json_dumps():
    numpy_float = {**CHUNK, "usage": {"logprob": np.float64(-0.5)}}
    assert json.loads(_json(numpy_float))["usage"] == {"logprob": -0.5}
    lone = {**CHUNK, "choices": [{"index": 0, "text": "a\ud800"}]}
    raw = _json(lone)
    assert b"\\ud800" in raw and json.loads(raw)["choices"][0]["text"] == "a\ud800"

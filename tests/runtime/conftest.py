"""Fixtures shared by the runtime's server tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_fixtures import ServerProcess, running_server


@pytest.fixture(scope="session")
def tiny_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One `kvfleet serve` of the tiny random Llama with default flags, shared by every test
    that needs no special server (each start costs seconds; tests read metrics as deltas)."""
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("serve-tiny")) as s:
        yield s


@pytest.fixture(scope="session")
def tiny_client(tiny_server: ServerProcess) -> openai.OpenAI:
    """The official OpenAI client pointed at `tiny_server`."""
    return openai.OpenAI(base_url=tiny_server.api_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def one_calls(monkeypatch) -> list[int]:
    """The row count of every decode step run as one C call from token ids to logits
    (`DecodeLogits.run`), in order; the calls still run."""
    from kvfleet.kernels.cpu import cpu_decode_logits

    calls: list[int] = []
    run = cpu_decode_logits.DecodeLogits.run

    def counted(self, input_ids, *args, **kwargs):
        calls.append(len(input_ids))
        return run(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(cpu_decode_logits.DecodeLogits, "run", counted)
    return calls

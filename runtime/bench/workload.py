"""The standard benchmark workload, shared by `bench throughput` and `bench serve`.

Seeded: 128 requests, prompt lengths uniform in [32, 512], output lengths uniform in [16, 256],
generated with ignore_eos so every request produces exactly its output length (about 35k prompt
and 18k output tokens). Prompt tokens are drawn from the tokenizer's ordinary vocabulary
(special tokens excluded) so text-based servers can be driven with the same prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

PROMPT_LEN = (32, 512)
OUTPUT_LEN = (16, 256)


@dataclass(slots=True)
class WorkloadItem:
    prompt_token_ids: list[int]
    output_len: int


def standard_workload(
    tokenizer: Any,
    num_prompts: int = 128,
    seed: int = 0,
    prompt_len: tuple[int, int] = PROMPT_LEN,
    output_len: tuple[int, int] = OUTPUT_LEN,
    vocab_size: int | None = None,
) -> list[WorkloadItem]:
    rng = np.random.default_rng(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = vocab_size or len(tokenizer)
    pool = np.array([t for t in range(vocab) if t not in special], dtype=np.int64)
    items = []
    for _ in range(num_prompts):
        n_in = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        n_out = int(rng.integers(output_len[0], output_len[1] + 1))
        items.append(WorkloadItem(rng.choice(pool, size=n_in).tolist(), n_out))
    return items

"""Random LoRA adapters in PEFT's format, made by the tests (no download), and the base model
with one merged in (PEFT's `merge_and_unload`): the reference an adapter's tokens are checked
against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(
    base: Path | str,
    path: Path | str,
    rank: int = 8,
    seed: int = 0,
    target_modules: tuple[str, ...] = ALL_MODULES,
    alpha: int | None = None,
    std: float = 0.05,
    **config: Any,
) -> Path:
    """Write a random rank-`rank` adapter of the model in folder `base` to `path` (both A and
    B random, so it changes the model's tokens; `std` their spread) and return `path`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32)
    lora = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(target_modules),
        init_lora_weights=False,
        **config,
    )
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    path = Path(path)
    peft_model.save_pretrained(str(path))
    return path


def merged_model(base: Path | str, adapter: Path | str) -> Any:
    """The float32 transformers model of `base` with `adapter` merged into its weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()


def greedy_tokens_batch(
    model: Any, prompts: list[list[int]], max_tokens: int, eos_token_id: int
) -> list[list[int]]:
    """transformers' greedy continuations of equally long prompts, in one batch (no padding,
    so each row is computed as it would be alone), each cut after its first EOS."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("prompts: must all have the same length (no padding)")
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )
    rows = []
    for row in out[:, ids.shape[1] :].tolist():
        rows.append(row[: row.index(eos_token_id) + 1] if eos_token_id in row else row)
    return rows

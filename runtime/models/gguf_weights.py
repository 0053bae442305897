"""A GGUF file's projection weights kept quantized: Q4_0, Q4_1 and Q8_0 blocks read straight into
the kernels' layout (kernels/quant_weight.py), whose int4 nibble order is GGUF's own, so only
each block's fp16 scale (and Q4_1's minimum) moves. Other tensor types are dequantized by the
`gguf` library and served as plain weights.

Blocks hold 32 weights: Q4_0 = fp16 d + 16 bytes, w = d * (q - 8); Q4_1 = fp16 d, fp16 m + 16
bytes, w = d * q + m; Q8_0 = fp16 d + 32 int8, w = d * q. llama.cpp stores a Llama model's q
and k rows permuted for its rotary layout; they are put back in transformers' order here, as
transformers' own GGUF loader does (the permutation moves whole rows, so it applies to
quantized rows alike).
"""

from __future__ import annotations

import numpy as np
import torch
from kvfleet.kernels.quant_weight import QuantizedWeight
from kvfleet.runtime.models.errors import ModelLoadError
from kvfleet.runtime.models.gguf_index import GGUFIndex

# GGUF tensor names per Hugging Face module, for the Llama-family layers.
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def gguf_name(module: str) -> str:
    """The GGUF tensor name of a Hugging Face module ("model.layers.3.mlp.down_proj" ->
    "blk.3.ffn_down.weight"; "lm_head" -> "output.weight")."""
    if module == "lm_head":
        return "output.weight"
    if module == "model.embed_tokens":
        return "token_embd.weight"
    parts = module.split(".")
    if len(parts) < 4 or parts[:2] != ["model", "layers"]:
        raise KeyError(module)
    return f"blk.{parts[2]}.{_LAYER_NAMES['.'.join(parts[3:])]}.weight"


def _rows_unpermuted(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation for `heads` heads (transformers'
    reverse permutation, applied to row indices)."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


class GGUFWeights:
    """Reads a GGUF file's weights by Hugging Face module name."""

    def __init__(self, index: GGUFIndex, num_heads: int, num_kv_heads: int) -> None:
        self.path = index.path
        self._tensors = index.tensors
        self._heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
        self._permuted = index.architecture == "llama"

    def projection(self, module: str, out_f: int, in_f: int) -> QuantizedWeight | torch.Tensor:
        """Module's [out_f, in_f] weight: quantized where its type is one of KEPT_TYPES, else
        dequantized to float32."""
        name = gguf_name(module)
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"model: {self.path.name} lacks the tensor {name!r}")
        shape = tuple(reversed(tensor.shape))  # GGUF lists dims innermost first
        if shape != (out_f, in_f):
            raise ModelLoadError(
                f"model: {self.path.name}'s {name} has shape {shape}, config implies "
                f"{(out_f, in_f)}"
            )
        kind = tensor.tensor_type.name
        data = np.asarray(tensor.data)
        short = name.split(".")[2] if name.startswith("blk.") else ""
        order = None
        if self._permuted and short in self._heads:
            order = _rows_unpermuted(out_f, self._heads[short])
        if kind not in KEPT_TYPES:
            from gguf.quants import dequantize

            plain = dequantize(data, tensor.tensor_type).reshape(out_f, in_f)
            if order is not None:
                plain = plain[order]
            return torch.from_numpy(np.ascontiguousarray(plain, dtype=np.float32))
        if order is not None:
            data = data[order]
        return _blocks(kind, data, out_f, in_f)


def _blocks(kind: str, data: np.ndarray, out_f: int, in_f: int) -> QuantizedWeight:
    """Rows of GGUF blocks (uint8 [out_f, bytes a row]) in the kernels' layout."""
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = np.ascontiguousarray(data).reshape(out_f, in_f // 32, block_bytes)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if kind == "Q8_0":
        q = blocks[:, :, 2:].copy().view(np.int8).reshape(out_f, in_f)
        return QuantizedWeight(
            "int8", torch.from_numpy(q), torch.from_numpy(d), None, out_f, in_f, 32
        )
    if kind == "Q4_0":
        qs, offsets = blocks[:, :, 2:], -8.0 * d  # exact: a power-of-two multiple
    else:
        qs = blocks[:, :, 4:]
        offsets = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
    packed = np.ascontiguousarray(qs).reshape(out_f, in_f // 2)
    return QuantizedWeight(
        "int4", torch.from_numpy(packed), torch.from_numpy(d),
        torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.float32)), out_f, in_f, 32,
    )  # fmt: skip

"""Quantized checkpoints of a plain Hugging Face folder, written the way each format publishes
them, and beside each the plain float32 folder of the same weights after dequantization (what
its greedy tokens are checked against).

Packing follows each format's own convention: AWQ's int32 words along the output dimension in
its interleaved nibble order, GPTQ's along the input dimension with zero points stored minus
one, compressed-tensors' through its own `pack_to_int32`; FP8 weights are float8_e4m3fn with
a per-tensor ("fp8") or per-channel (compressed-tensors) scale.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from kvfleet.kernels.quant_weight import QuantizedWeight, dequantize, quantize_int4, unpack_int4
from safetensors.torch import load_file, save_file

FORMATS = ("awq", "gptq", "ct-int4", "fp8", "ct-fp8")
GROUP = 32
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# AWQ's nibble i of a word holds output 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _pack_last(values: torch.Tensor) -> torch.Tensor:
    """int [..., n] of 0..15 -> int32 [..., n / 8]: element 8c + i at nibble i of word c."""
    v = values.to(torch.int32).reshape(*values.shape[:-1], -1, 8)
    return (v << _SHIFTS).sum(-1, dtype=torch.int32)


def _int4_parts(w: torch.Tensor, symmetric: bool) -> tuple[QuantizedWeight, torch.Tensor]:
    """The weight quantized (as the kernels hold it) and its zero points [out, in / GROUP]."""
    qw = quantize_int4(w, GROUP, symmetric=symmetric)
    zeros = (-qw.offsets / qw.scales).round().to(torch.int32)
    return qw, zeros


def _awq(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], QuantizedWeight]:
    qw, zeros = _int4_parts(w, symmetric=False)
    q = unpack_int4(qw.qweight).to(torch.int32)
    order = list(AWQ_ORDER)
    q_t = q.T.reshape(q.shape[1], -1, 8)[:, :, order].reshape(q.shape[1], -1)
    z_t = zeros.T.reshape(zeros.shape[1], -1, 8)[:, :, order].reshape(zeros.shape[1], -1)
    return {
        f"{name}.qweight": _pack_last(q_t),
        f"{name}.qzeros": _pack_last(z_t),
        f"{name}.scales": qw.scales.T.contiguous().half(),
    }, qw


def _gptq(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], QuantizedWeight]:
    qw, zeros = _int4_parts(w, symmetric=True)
    q = unpack_int4(qw.qweight).to(torch.int32)
    in_f = q.shape[1]
    qweight = _pack_last(q).T.contiguous()  # [in / 8, out]: input 8r + i at nibble i of row r
    return {
        f"{name}.qweight": qweight,
        f"{name}.qzeros": _pack_last(((zeros - 1) & 0xF).T.contiguous()),
        f"{name}.scales": qw.scales.T.contiguous().half(),
        f"{name}.g_idx": torch.arange(in_f, dtype=torch.int32) // GROUP,
    }, qw


def _ct_int4(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], QuantizedWeight]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    qw, _ = _int4_parts(w, symmetric=True)
    signed = (unpack_int4(qw.qweight).to(torch.int32) - 8).to(torch.int8)
    return {
        f"{name}.weight_packed": pack_to_int32(signed, 4),
        f"{name}.weight_scale": qw.scales.half(),
        f"{name}.weight_shape": torch.tensor(list(w.shape)),
    }, qw


def _fp8(
    name: str, w: torch.Tensor, per_channel: bool
) -> tuple[dict[str, torch.Tensor], QuantizedWeight]:
    fmax = torch.finfo(torch.float8_e4m3fn).max
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(())
    scale = (amax / fmax).clamp_min(1e-12).float()
    q = (w / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
    out_f, in_f = w.shape
    scales = scale.reshape(-1, 1).expand(out_f, 1).contiguous()
    qw = QuantizedWeight("fp8", q, scales, None, out_f, in_f, in_f)
    return {f"{name}.weight": q, f"{name}.weight_scale": scale}, qw


def _quantization_config(fmt: str) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                "sym": True, "checkpoint_format": "gptq"}  # fmt: skip
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    int4 = fmt == "ct-int4"
    weights = {
        "num_bits": 4 if int4 else 8,
        "type": "int" if int4 else "float",
        "symmetric": True,
        "strategy": "group" if int4 else "channel",
        "group_size": GROUP if int4 else None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized" if int4 else "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }


def write_quantized(plain: Path, root: Path, fmt: str) -> tuple[Path, Path]:
    """(the `fmt` checkpoint of `plain`'s weights, the plain float32 folder of what it
    dequantizes to), both under `root`."""
    quant, ref = root / fmt, root / f"{fmt}-dequantized"
    for folder in (quant, ref):
        shutil.copytree(plain, folder, dirs_exist_ok=True)
    state = load_file(str(plain / "model.safetensors"))
    quant_state, ref_state = {}, {}
    for key, tensor in state.items():
        module = key.removesuffix(".weight")
        if not (key.endswith(".weight") and module.split(".")[-1] in _PROJECTIONS):
            quant_state[key] = ref_state[key] = tensor
            continue
        w = tensor.float()
        if fmt == "awq":
            tensors, qw = _awq(module, w)
        elif fmt == "gptq":
            tensors, qw = _gptq(module, w)
        elif fmt == "ct-int4":
            tensors, qw = _ct_int4(module, w)
        else:
            tensors, qw = _fp8(module, w, per_channel=fmt == "ct-fp8")
        quant_state.update(tensors)
        ref_state[key] = dequantize(qw)
    save_file(quant_state, str(quant / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref_state, str(ref / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps(config, indent=2))
    config["quantization_config"] = _quantization_config(fmt)
    (quant / "config.json").write_text(json.dumps(config, indent=2))
    return quant, ref

"""Quantized projections of a Hugging Face checkpoint (AWQ, GPTQ, FP8, compressed-tensors), read
into the kernels' one layout (kernels/quant_weight.py) once at load.

Each format's unpacking follows its own library where PyPI has one: AWQ's through
compressed-tensors' AutoAWQ converter, compressed-tensors' packed int4 through its
`unpack_from_int32`; GPTQ's (no maintained library outside its GPU kernels) is written here from
its packing: 8 nibbles per int32 along the input dimension for weights and along the output
dimension for zero points, which the historical "gptq" format stores minus one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from kvfleet.kernels.quant_weight import QuantizedWeight, pack_int4
from kvfleet.runtime.models.errors import ModelLoadError
from kvfleet.runtime.models.quantization import QuantScheme, is_ignored

# A checkpoint tensor by full name, or None where the checkpoint lacks it.
Fetch = Callable[[str], "torch.Tensor | None"]

_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _need(fetch: Fetch, name: str) -> torch.Tensor:
    t = fetch(name)
    if t is None:
        raise ModelLoadError(f"model: the quantized checkpoint lacks the tensor {name!r}")
    return t


def _check_shape(name: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(t.shape) != want:
        raise ModelLoadError(
            f"model: quantized tensor {name!r} has shape {tuple(t.shape)}, config.json and the "
            f"quantization_config imply {want}"
        )


def _int4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> QuantizedWeight:
    """A weight from q [out, in] (0..15), float scales and zero points [out, in / group]:
    w = scale * (q - zero), held as scale * q + offset with offset = -scale * zero (exact in
    float32 for fp16/bf16 scales and zeros up to 16)."""
    out_features, in_features = q.shape
    s = scales.float().contiguous()
    return QuantizedWeight(
        "int4", pack_int4(q), s, (-s * zeros.float()).contiguous(),
        out_features, in_features, group,
    )  # fmt: skip


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [r, c] -> [r * 8, c]: nibble i of word (r, c) becomes row 8r + i."""
    nibbles = (words.unsqueeze(1) >> _NIBBLE_SHIFTS.view(1, 8, 1)) & 0xF
    return nibbles.reshape(words.shape[0] * 8, words.shape[1])


def _unpack_cols(words: torch.Tensor) -> torch.Tensor:
    """int32 [r, c] -> [r, c * 8]: nibble i of word (r, c) becomes column 8c + i."""
    nibbles = (words.unsqueeze(-1) >> _NIBBLE_SHIFTS.view(1, 1, 8)) & 0xF
    return nibbles.reshape(words.shape[0], words.shape[1] * 8)


def _awq(fetch: Fetch, module: str, out_f: int, in_f: int, scheme: QuantScheme):
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    if not scheme.zero_point:
        raise ModelLoadError("quantization: AWQ without zero points is not supported")
    group = scheme.group_size or in_f
    qweight, qzeros = _need(fetch, f"{module}.qweight"), _need(fetch, f"{module}.qzeros")
    scales = _need(fetch, f"{module}.scales")
    _check_shape(f"{module}.qweight", qweight, (in_f, out_f // 8))
    _check_shape(f"{module}.qzeros", qzeros, (in_f // group, out_f // 8))
    _check_shape(f"{module}.scales", scales, (in_f // group, out_f))
    iweight, izeros = AutoAWQConverter.unpack_awq(qweight, qzeros, 4)
    iweight, izeros = AutoAWQConverter.reverse_awq_order(iweight, izeros, 4)
    q, zeros = (iweight & 0xF).T.contiguous(), (izeros & 0xF).T
    return _int4(q, scales.T, zeros, group)


def _gptq(fetch: Fetch, module: str, out_f: int, in_f: int, scheme: QuantScheme):
    group = scheme.group_size or in_f
    qweight, qzeros = _need(fetch, f"{module}.qweight"), _need(fetch, f"{module}.qzeros")
    scales = _need(fetch, f"{module}.scales")
    _check_shape(f"{module}.qweight", qweight, (in_f // 8, out_f))
    _check_shape(f"{module}.qzeros", qzeros, (in_f // group, out_f // 8))
    _check_shape(f"{module}.scales", scales, (in_f // group, out_f))
    g_idx = fetch(f"{module}.g_idx")
    if g_idx is not None and not torch.equal(
        g_idx.to(torch.int64), torch.arange(in_f, dtype=torch.int64) // group
    ):
        raise ModelLoadError(
            f"quantization: {module}'s GPTQ g_idx reorders its input rows (desc_act true); "
            "only checkpoints quantized with desc_act false (or an identity g_idx) load"
        )
    zeros = _unpack_cols(qzeros)
    if scheme.checkpoint_format == "gptq":
        zeros = zeros + 1  # the historical format's off-by-one, which every GPTQ kernel undoes
    q = _unpack_rows(qweight).T.contiguous()
    return _int4(q, scales.T, zeros.T, group)


def _float8(fetch: Fetch, module: str, out_f: int, in_f: int):
    weight, scale = _need(fetch, f"{module}.weight"), fetch(f"{module}.weight_scale")
    if scale is None:
        raise ModelLoadError(f"model: the FP8 checkpoint lacks {module}.weight_scale")
    _check_shape(f"{module}.weight", weight, (out_f, in_f))
    if weight.dtype != torch.float8_e4m3fn:
        raise ModelLoadError(
            f"quantization: {module}.weight is {weight.dtype}; FP8 weights must be float8_e4m3fn"
        )
    if scale.numel() not in (1, out_f):
        raise ModelLoadError(
            f"quantization: {module}.weight_scale has {scale.numel()} values; per-tensor (1) "
            f"or per-channel ({out_f}) scales load"
        )
    scales = scale.float().reshape(-1, 1).expand(out_f, 1).contiguous()
    return QuantizedWeight("fp8", weight.contiguous(), scales, None, out_f, in_f, in_f)


def _packed_int4(fetch: Fetch, module: str, out_f: int, in_f: int, scheme: QuantScheme):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    group = scheme.group_size or in_f
    packed, scales = _need(fetch, f"{module}.weight_packed"), _need(fetch, f"{module}.weight_scale")
    _check_shape(f"{module}.weight_packed", packed, (out_f, in_f // 8))
    _check_shape(f"{module}.weight_scale", scales, (out_f, in_f // group))
    signed = unpack_from_int32(packed, 4, torch.Size((out_f, in_f)))
    zeros = torch.zeros(out_f, in_f // group)
    packed_zeros = fetch(f"{module}.weight_zero_point")
    if scheme.zero_point and packed_zeros is not None:
        zeros = unpack_from_int32(
            packed_zeros, 4, torch.Size((out_f, in_f // group)), packed_dim=0
        ).float()
    # Values are stored signed (-8..7): q = signed + 8, and the zero point moves with them.
    return _int4((signed.to(torch.int32) + 8).contiguous(), scales, zeros + 8, group)


def read_projection(
    fetch: Fetch, module: str, out_f: int, in_f: int, scheme: QuantScheme
) -> QuantizedWeight | None:
    """Module `module`'s weight ([out_f, in_f] as it would be plain) in the kernels' layout, or
    None where the scheme leaves it unquantized (its plain `.weight` is read instead)."""
    if is_ignored(scheme, module):
        return None
    if scheme.method == "awq":
        return _awq(fetch, module, out_f, in_f, scheme)
    if scheme.method == "gptq":
        return _gptq(fetch, module, out_f, in_f, scheme)
    if scheme.weight_type == "float":
        return _float8(fetch, module, out_f, in_f)
    return _packed_int4(fetch, module, out_f, in_f, scheme)

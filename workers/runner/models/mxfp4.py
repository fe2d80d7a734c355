"""MXFP4 checkpoints (gpt-oss's experts): dequantized to floats once, at load.

A config with `quantization_config.quant_method == "mxfp4"` stores each quantized tensor
`X` as two: `X_blocks`, uint8 [..., rows, groups, 16], two FP4 (e2m1) values a byte, the low
nibble first; and `X_scales`, uint8 [..., rows, groups], one power-of-two exponent per group of
32 values, biased by 127. Value = FP4 code's value * 2 ** (scale - 127). The rows are the
projection's outputs, the groups its inputs; the tensor read back is transposed to the
layout of the unquantized checkpoint ([..., inputs, outputs], as transformers'
`convert_moe_packed_tensors` gives it), so the family's conversion of the plain tensor then
applies unchanged. Every value is exact in float32 (and in bfloat16, within its exponents).
"""

from __future__ import annotations

from typing import Any

import torch

METHOD = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"
# the 16 e2m1 codes: sign bit, 2 exponent bits, 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
_ROWS = 4096  # rows dequantized at a time


def quant_method(config: Any) -> str | None:
    """The config's `quantization_config.quant_method` (a dict or an object), or None."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(
        quant, "quant_method", None)
    return None if method is None else str(method)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., groups * 32, rows] in `dtype` from `X_blocks` [..., rows, groups, 16] and
    `X_scales` [..., rows, groups] (a transposed view: the unquantized checkpoint's layout).
    Each chunk of rows is computed in float32 and written into the `dtype` result, so loading
    into a bfloat16 model holds no float32 copy of the whole tensor (gpt-oss-120b's stacked
    experts are 2.1 G values a layer); the values are exact in either."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, not {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.dim() < 3 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)}")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    *lead, groups, width = blocks.shape
    flat_blocks = blocks.reshape(-1, groups, width)
    flat_scales = scales.reshape(-1, groups)
    out = torch.empty(flat_blocks.shape[0], groups, 2 * width, dtype=dtype)
    for start in range(0, out.shape[0], _ROWS):  # the index tensors stay small
        codes = flat_blocks[start : start + _ROWS].long()
        chunk = torch.empty(codes.shape[0], groups, 2 * width, dtype=torch.float32)
        chunk[..., 0::2] = table[codes & 0x0F]  # the low nibble is the even element
        chunk[..., 1::2] = table[codes >> 4]
        exponents = flat_scales[start : start + _ROWS].to(torch.int32) - SCALE_BIAS
        torch.ldexp(chunk, exponents[..., None], out=chunk)
        out[start : start + _ROWS].copy_(chunk)
    return out.view(*lead, groups * 2 * width).transpose(-1, -2)

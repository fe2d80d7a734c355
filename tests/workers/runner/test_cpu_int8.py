"""The few-row int8 kernel against the dequantized float product, on every build target."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.workers.runner.conftest import build_targets
from workers.runner import cpu_int8
from workers.runner.quantization import quantize_per_channel

TARGETS = build_targets()


@pytest.mark.parametrize("rows", [1, 2, 5, cpu_int8.MAX_ROWS])
@pytest.mark.parametrize("out_features, in_features", [(64, 48), (67, 40), (6, 2100)])
@pytest.mark.parametrize("march", TARGETS)
def test_product_equals_the_dequantized_one(rows, out_features, in_features, march):
    """Channels past a multiple of four, and rows too long to widen in L1 (k > 2048)."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    q, scale = quantize_per_channel(torch.randn(out_features, in_features, generator=gen))
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    weight = q.float() * scale[:, None]
    for b in (None, bias):
        got = cpu_int8.int8_gemv(x, q, scale, b, march=march)
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-4, atol=1e-4)


def test_strided_rows_and_the_row_limit():
    q, scale = quantize_per_channel(torch.randn(32, 40))
    wide = torch.randn(3, 100)
    x = wide[:, :40]  # row stride 100
    torch.testing.assert_close(cpu_int8.int8_gemv(x, q, scale),
                               F.linear(x.contiguous(), q.float() * scale[:, None]),
                               rtol=1e-5, atol=1e-5)
    assert not cpu_int8.fits(torch.randn(cpu_int8.MAX_ROWS + 1, 40))
    assert not cpu_int8.fits(torch.randn(2, 40).bfloat16())
    assert not cpu_int8.fits(torch.randn(40, 2).t())  # columns strided
    with pytest.raises(AssertionError):
        cpu_int8.int8_gemv(torch.randn(cpu_int8.MAX_ROWS + 1, 40), q, scale)


def test_it_builds_in_an_empty_cache(fresh_build):
    q, scale = quantize_per_channel(torch.randn(8, 16))
    x = torch.randn(1, 16)
    torch.testing.assert_close(cpu_int8.int8_gemv(x, q, scale),
                               F.linear(x, q.float() * scale[:, None]), rtol=1e-5, atol=1e-5)
    assert any(p.name.startswith("int8_gemv-") for p in fresh_build.iterdir())

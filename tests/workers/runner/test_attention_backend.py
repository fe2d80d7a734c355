"""Which attention backend a runner gets, and that asking for an impossible one fails loudly."""

from __future__ import annotations

import pytest
import torch

from workers.runner import cbuild, cpu_amx, cpu_decode, flash_prefill, vec_prefill
from workers.runner.attention_backend import pick_attention_backend, pick_prefill_attention

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_an_in_place_kernel_on_each_device():
    assert pick_attention_backend("auto", CPU, 16, 64) == "cpu"
    assert pick_attention_backend("auto", CUDA, 16, 64) == "triton"
    assert pick_attention_backend("torch", CUDA, 16, 64) == "torch"
    assert pick_attention_backend("torch", CPU, 16, 64) == "torch"


def test_auto_on_cpu_keeps_torch_where_the_c_kernel_does_not_fit():
    assert pick_attention_backend("auto", CPU, 16, 64, dtype=torch.float16) == "torch"
    assert pick_attention_backend("auto", CPU, 16, 64, dtype=torch.bfloat16,
                                  kv_cache_dtype="int8") == "torch"
    assert pick_attention_backend("auto", CPU, 16, 64, group=32) == "torch"
    assert pick_attention_backend("auto", CPU, 512, 64) == "torch"


def test_auto_on_cpu_takes_the_c_kernel_for_bfloat16_over_a_bfloat16_pool():
    assert pick_attention_backend("auto", CPU, 16, 64, dtype=torch.bfloat16) == "cpu"
    with pytest.raises(ValueError, match="bfloat16 with a bfloat16 pool"):
        pick_attention_backend("cpu", CPU, 16, 64, dtype=torch.bfloat16, kv_cache_dtype="int8")


def test_a_kernel_that_does_not_build_is_torch_under_auto_and_an_error_if_asked(monkeypatch):
    def no_compiler():
        raise RuntimeError("the CPU decode kernel needs a C compiler (cc or gcc, or $CC)")

    monkeypatch.setattr(cpu_decode, "load_library", no_compiler)
    assert pick_attention_backend("auto", CPU, 16, 64) == "torch"
    with pytest.raises(RuntimeError, match="needs a C compiler"):
        pick_attention_backend("cpu", CPU, 16, 64)


def test_auto_keeps_torch_where_the_kernel_does_not_fit():
    assert pick_attention_backend("auto", CUDA, 12, 64) == "torch"
    assert pick_attention_backend("auto", CUDA, 16, 512) == "torch"


@pytest.mark.parametrize(
    ("name", "device", "block_size", "match"),
    [
        ("flash", CPU, 16, "must be one of auto, torch, triton, cpu"),
        ("triton", CUDA, 12, "power-of-two block_size"),
        ("cpu", CUDA, 16, "needs a CPU device"),
        ("cpu", CPU, 512, "block_size <= 256"),
    ],
)
def test_impossible_backends_are_refused(name, device, block_size, match):
    with pytest.raises(ValueError, match=match):
        pick_attention_backend(name, device, block_size, 64)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pick_attention_backend("triton", CPU, 16, 64) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        pick_attention_backend("triton", CPU, 16, 64)


def test_prefill_attention_is_flash_on_cpu_and_causal_on_cuda():
    assert pick_prefill_attention("auto", CPU) == "flash"  # float32 stays on the flash split
    assert pick_prefill_attention("auto", CUDA) == "causal"
    assert pick_prefill_attention("masked", CPU) == "masked"
    assert pick_prefill_attention("flash", CPU) == "flash"


def test_prefill_attention_without_the_fused_kernel_is_masked_or_refused(monkeypatch):
    monkeypatch.setattr(flash_prefill, "_FLASH", None)
    assert pick_prefill_attention("auto", CPU) == "masked"
    with pytest.raises(ValueError, match="_scaled_dot_product_flash_attention_for_cpu"):
        pick_prefill_attention("flash", CPU)


@pytest.mark.parametrize(("name", "device", "match"), [
    ("flash", CUDA, "needs a CPU device"),
    ("math", CPU, "must be one of auto, flash, masked, amx, vec"),
])
def test_impossible_prefill_attention_is_refused(name, device, match):
    with pytest.raises(ValueError, match=match):
        pick_prefill_attention(name, device)


@pytest.mark.parametrize("amx", [False, True])
def test_prefill_attention_is_amx_for_bfloat16_heads_of_64_or_128_where_amx_runs(monkeypatch,
                                                                                amx):
    monkeypatch.setattr(cpu_amx, "available", lambda: amx)
    monkeypatch.setattr(vec_prefill, "fits", lambda *args: False)
    bf16 = {"dtype": torch.bfloat16, "head_dim": 64}
    assert pick_prefill_attention("auto", CPU, **bf16) == ("amx" if amx else "flash")
    assert pick_prefill_attention("auto", CPU, dtype=torch.bfloat16,
                                  head_dim=128) == ("amx" if amx else "flash")
    assert pick_prefill_attention("auto", CPU, dtype=torch.bfloat16, head_dim=96) == "flash"
    assert pick_prefill_attention("auto", CPU, dtype=torch.float32, head_dim=64) == "flash"
    assert pick_prefill_attention("auto", CUDA, **bf16) == "causal"
    if amx:
        assert pick_prefill_attention("amx", CPU, **bf16) == "amx"
    with pytest.raises(ValueError, match="prefill_attention 'amx' needs bfloat16"):
        pick_prefill_attention("amx", CPU, dtype=torch.float32, head_dim=64)


@pytest.mark.parametrize("amx", [False, True])
def test_prefill_attention_is_vec_where_it_runs_and_amx_does_not(monkeypatch, amx):
    """`vec` wherever its kernel takes the dtype and heads (AVX-512 float32, AVX-512 BF16
    bfloat16), after `amx`; flash where it does not."""
    monkeypatch.setattr(cpu_amx, "available", lambda: amx)
    monkeypatch.setattr(vec_prefill, "fits",
                        lambda dtype, head_dim, device: device.type == "cpu"
                        and head_dim in (64, 128) and dtype == torch.float32)
    monkeypatch.setattr(cbuild, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    assert pick_prefill_attention("auto", CPU, dtype=torch.float32, head_dim=64) == "vec"
    assert pick_prefill_attention("auto", CPU, dtype=torch.float32, head_dim=128) == "vec"
    assert pick_prefill_attention("auto", CPU, dtype=torch.float32, head_dim=96) == "flash"
    assert pick_prefill_attention("auto", CPU, dtype=torch.bfloat16,
                                  head_dim=64) == ("amx" if amx else "flash")
    assert pick_prefill_attention("auto", CUDA, dtype=torch.float32, head_dim=64) == "causal"
    assert pick_prefill_attention("vec", CPU, dtype=torch.float32, head_dim=64) == "vec"
    with pytest.raises(ValueError, match="prefill_attention 'vec' needs heads of 64 or 128"):
        pick_prefill_attention("vec", CPU, dtype=torch.bfloat16, head_dim=64)


def test_prefill_attention_auto_keeps_the_flash_split_on_avx2(monkeypatch):
    """The AVX2 build of the vector kernel runs, so `vec` may be asked for, but `auto`
    stays on the flash split there (not measured faster)."""
    monkeypatch.setattr(cpu_amx, "available", lambda: False)
    monkeypatch.setattr(vec_prefill, "fits", lambda dtype, head_dim, device: True)
    monkeypatch.setattr(cbuild, "cpu_flags", lambda: {"avx2", "fma"})
    assert pick_prefill_attention("auto", CPU, dtype=torch.float32, head_dim=64) == "flash"
    assert pick_prefill_attention("vec", CPU, dtype=torch.float32, head_dim=64) == "vec"

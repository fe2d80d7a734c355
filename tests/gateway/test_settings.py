"""Settings that are checked when the gateway starts, not when first used."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.settings import Settings


def test_embedded_speculative_is_read_from_json_and_checked(monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED_SPECULATIVE", '{"method": "ngram", "num_tokens": 3}')
    assert Settings().embedded_speculative == {"method": "ngram", "num_tokens": 3}
    for bad in ('{"method": "medusa"}', '{"method": "ngram", "k": 3}',
                '{"method": "draft"}', '{"num_tokens": 99}'):
        monkeypatch.setenv("SWITCHBOARD_EMBEDDED_SPECULATIVE", bad)
        with pytest.raises(ValidationError, match="embedded_speculative"):
            Settings()


def test_embedded_int8_compute_is_checked(monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED_INT8_COMPUTE", "bfloat16")
    assert Settings().embedded_int8_compute == "bfloat16"
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED_INT8_COMPUTE", "int4")
    with pytest.raises(ValidationError, match="embedded_int8_compute"):
        Settings()


def test_embedded_dtype_is_checked(monkeypatch):
    assert Settings().embedded_dtype is None  # the engine's own default
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED_DTYPE", "bfloat16")
    assert Settings().embedded_dtype == "bfloat16"
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED_DTYPE", "float16")
    with pytest.raises(ValidationError, match="embedded_dtype"):
        Settings()

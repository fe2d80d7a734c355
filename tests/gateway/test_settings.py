"""Settings that are checked when the gateway starts, not when first used."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.settings import Settings


def test_embedded_speculative_is_read_from_json_and_checked(monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED__SPECULATIVE", '{"method": "ngram", "num_tokens": 3}')
    assert Settings().embedded.speculative == {"method": "ngram", "num_tokens": 3}
    for bad in ('{"method": "medusa"}', '{"method": "ngram", "k": 3}',
                '{"method": "draft"}', '{"num_tokens": 99}'):
        monkeypatch.setenv("SWITCHBOARD_EMBEDDED__SPECULATIVE", bad)
        with pytest.raises(ValidationError, match=r"embedded\.speculative"):
            Settings()


def test_embedded_int8_compute_is_checked(monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED__INT8_COMPUTE", "bfloat16")
    assert Settings().embedded.int8_compute == "bfloat16"
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED__INT8_COMPUTE", "int4")
    with pytest.raises(ValidationError, match=r"embedded\.int8_compute"):
        Settings()


def test_embedded_dtype_is_checked(monkeypatch):
    assert Settings().embedded.dtype is None  # the engine's own default
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED__DTYPE", "bfloat16")
    assert Settings().embedded.dtype == "bfloat16"
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED__DTYPE", "float8")
    with pytest.raises(ValidationError, match=r"embedded\.dtype"):
        Settings()


def test_engine_settings_nest_the_engine_arguments_with_serving_defaults(monkeypatch):
    """Declared once (`workers.config.EngineArgs`): every engine argument is a nested setting,
    with the serving defaults a worker has too."""
    from workers.config import SERVING_DEFAULTS, EngineArgs

    monkeypatch.setenv("SWITCHBOARD_EMBEDDED__MAX_NUM_SEQS", "12")
    settings = Settings()
    assert settings.embedded.max_num_seqs == 12
    for name in EngineArgs.model_fields:
        if name != "model":
            expected = SERVING_DEFAULTS.get(name, EngineArgs.model_fields[name].default)
            assert getattr(Settings().embedded, name) == expected or name == "max_num_seqs"
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED__MAX_NUM_SEQS", "0")
    with pytest.raises(ValidationError, match="max_num_seqs"):
        Settings()


def test_several_embedded_models_each_a_deployment(monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED__MODEL", "none")
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED_MODELS", '[{"model": "/m/a", "name": "a", '
                       '"tier": "standard", "kv_cache_memory": 1024}, {"model": "/m/b", '
                       '"name": "b", "enable_lora": false}]')
    engines = Settings().embedded_engines()
    assert list(engines) == ["embedded-a", "embedded-b"]
    assert engines["embedded-a"].tier == "standard"
    assert engines["embedded-a"].engine_kwargs()["kv_cache_memory"] == 1024
    assert engines["embedded-a"].enable_lora and not engines["embedded-b"].enable_lora


def test_a_flat_engine_setting_is_an_error_that_names_the_nested_one(monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED_MAX_NUM_SEQS", "7")
    with pytest.raises(ValidationError, match="set SWITCHBOARD_EMBEDDED__MAX_NUM_SEQS instead"):
        Settings()
    monkeypatch.delenv("SWITCHBOARD_EMBEDDED_MAX_NUM_SEQS")
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED__MAX_NUM_SEQS", "7")
    monkeypatch.setenv("SWITCHBOARD_EMBEDDED_MODELS", "[]")  # a setting of its own, not nested
    settings = Settings()
    assert settings.embedded.max_num_seqs == 7 and settings.embedded_models == []

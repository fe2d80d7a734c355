"""Engine arguments are declared once: the worker's flags are generated from `EngineArgs`,
with its types, choices, defaults and bounds, and the serving defaults on top."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from workers.config import SERVING_DEFAULTS, EngineArgs, add_engine_arguments, engine_args_from


def parser(**defaults) -> argparse.ArgumentParser:
    built = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(built, defaults=defaults)
    return built


def test_every_field_is_a_flag_with_its_default():
    args = engine_args_from(parser().parse_args([]))
    assert args == EngineArgs()
    served = engine_args_from(parser(**SERVING_DEFAULTS).parse_args([]))
    assert served.enable_lora is True and served.max_num_seqs == EngineArgs().max_num_seqs


def test_flags_are_typed_and_choices_and_bounds_hold():
    args = engine_args_from(parser().parse_args([
        "--max-num-seqs", "8", "--shared-step-s", "0.5", "--no-enable-prefix-caching",
        "--scheduling-policy", "fcfs", "--speculative", '{"method": "ngram", "num_tokens": 3}',
        "--model", "/m"]))
    assert (args.max_num_seqs, args.shared_step_s, args.enable_prefix_caching,
            args.scheduling_policy, args.model) == (8, 0.5, False, "fcfs", "/m")
    assert args.speculative == {"method": "ngram", "num_tokens": 3}
    with pytest.raises(argparse.ArgumentError):
        parser().parse_args(["--attention-backend", "nope"])
    with pytest.raises(ValidationError):
        engine_args_from(parser().parse_args(["--max-num-seqs", "0"]))
    with pytest.raises(ValueError, match="unknown speculative settings"):
        engine_args_from(parser().parse_args(["--speculative", '{"bogus": 1}']))


def test_unknown_keywords_are_refused_by_name():
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineArgs.from_kwargs(max_num_seq=4)

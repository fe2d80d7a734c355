"""Every bounded setting of a plan or key is held to its declaration in `tenancy.fields` by
each surface alike: the data functions, the admin API's schemas, the CLI's flags and the
console's form reader. Values just inside a bound pass everywhere; just outside, nowhere."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from pydantic import ValidationError
from starlette.datastructures import FormData

from gateway.commands.tenancy import register
from gateway.console.forms import FormReader
from gateway.schemas.admin import KeyCreate, PlanCreate
from tenancy import fields
from tenancy.errors import InvalidError

PLAN_NUMBERS = [field for field in fields.PLAN_SETTINGS.values()
                if isinstance(field, fields.Number) and field is not fields.BUDGET_MICROS]


def _inside(field: fields.Number) -> list[Any]:
    low = field.low + (1e-6 if field.above_low else 0)
    return [field.kind(low), field.kind(field.high)]


def _outside(field: fields.Number) -> list[Any]:
    if field.kind is int:
        return [field.low - 1, field.high + 1]
    return [field.kind(field.low) - (0 if field.above_low else 1e-6), field.high + 1e-3]


def _cases(numbers: list[fields.Number]) -> list[Any]:
    return [pytest.param(field, value, ok, id=f"{field.name}={value}")
            for field in numbers
            for ok, values in ((True, _inside(field)), (False, _outside(field)))
            for value in values]


def _flag(field: fields.Number) -> str:
    return "--" + field.name.replace("_", "-")


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    built = argparse.ArgumentParser(prog="switchboard")
    register(built.add_subparsers(dest="command", required=True))
    return built


def _cli_accepts(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    try:
        parser.parse_args(argv)
    except SystemExit:
        return False
    return True


def _form_accepts(field: fields.Number, value: Any) -> bool:
    form = FormReader(FormData({field.name: str(value)}))
    form.number(field)
    return form.ok


def _service_accepts(field: fields.Number, value: Any) -> bool:
    try:
        field.check(value)
    except InvalidError:
        return False
    return True


def _schema_accepts(model: type[PlanCreate] | type[KeyCreate], **body: Any) -> bool:
    try:
        model.model_validate(body)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize(("field", "value", "ok"), _cases(PLAN_NUMBERS))
def test_plan_settings(parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str],
                       field: fields.Number, value: Any, ok: bool) -> None:
    assert _service_accepts(field, value) is ok
    assert _schema_accepts(PlanCreate, name="p", **{field.name: value}) is ok
    assert _cli_accepts(parser, ["plans", "create", "--name", "p", _flag(field),
                                 str(value)]) is ok
    assert _form_accepts(field, value) is ok
    capsys.readouterr()  # argparse's usage errors


@pytest.mark.parametrize(("field", "value", "ok"), _cases(list(fields.KEY_LIMITS)))
def test_key_limits(parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str],
                    field: fields.Number, value: Any, ok: bool) -> None:
    assert _schema_accepts(KeyCreate, **{field.name: value}) is ok
    assert _cli_accepts(parser, ["keys", "create", "--tenant", "t", _flag(field),
                                 str(value)]) is ok
    capsys.readouterr()


def test_defaults_are_the_declarations(parser: argparse.ArgumentParser) -> None:
    """A plan created with nothing but a name gets each field's default on every surface."""
    args = parser.parse_args(["plans", "create", "--name", "p"])
    body = PlanCreate(name="p").model_dump()
    for name, field in fields.PLAN_SETTINGS.items():
        assert getattr(args, name) == field.default, name
        if name != "budget_micros":  # typed in USD by the API
            assert body[name] == field.default, name
    form = FormReader(FormData({}))
    assert [form.number(f) for f in (fields.RPM, fields.ENGINE_WEIGHT, fields.PRIORITY)] == [
        None, fields.ENGINE_WEIGHT.default, fields.PRIORITY.default]


@pytest.mark.parametrize("amount", ["1000000000", "0", "12.5"])
def test_budget_in_usd_within_bounds(parser: argparse.ArgumentParser, amount: str) -> None:
    args = parser.parse_args(["plans", "create", "--name", "p", "--budget-usd", amount])
    assert fields.BUDGET_MICROS.check(args.budget_micros) == args.budget_micros
    assert _schema_accepts(PlanCreate, name="p", budget_usd=amount)
    form = FormReader(FormData({"budget_usd": amount}))
    assert form.dollars("budget_usd") == args.budget_micros and form.ok


@pytest.mark.parametrize("amount", ["1000000000.01", "-0.01"])
def test_budget_in_usd_out_of_bounds(parser: argparse.ArgumentParser,
                                     capsys: pytest.CaptureFixture[str], amount: str) -> None:
    assert not _cli_accepts(parser, ["plans", "create", "--name", "p", "--budget-usd", amount])
    assert not _schema_accepts(PlanCreate, name="p", budget_usd=amount)
    form = FormReader(FormData({"budget_usd": amount}))
    form.dollars("budget_usd")
    assert not form.ok
    capsys.readouterr()

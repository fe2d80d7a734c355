"""The tenancy CLI commands, end to end on a SQLite file."""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from gateway.commands.tenancy import register
from gateway.settings import Settings
from tenancy.keys import hash_secret, load_or_create_pepper, parse_key


class Cli:
    """A tiny stand-in for `gateway.cli.main`: parse, then `args.func(args, settings)`."""

    def __init__(self, settings: Settings, capsys: pytest.CaptureFixture[str]) -> None:
        self.settings = settings
        self.capsys = capsys
        self.parser = argparse.ArgumentParser(prog="switchboard")
        register(self.parser.add_subparsers(dest="command", required=True))

    def run(self, *argv: str) -> tuple[int, str, str]:
        args = self.parser.parse_args(argv)
        code = args.func(args, self.settings)
        out, err = self.capsys.readouterr()
        return code, out, err

    def ok(self, *argv: str) -> Any:
        code, out, err = self.run(*argv)
        assert code == 0, err
        return json.loads(out)

    def fails(self, *argv: str) -> str:
        code, out, err = self.run(*argv)
        assert code != 0 and out == ""
        assert err.startswith("error: ")
        return err


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "switchboard.db"


@pytest.fixture
def cli(tmp_path: Path, db_path: Path, capsys: pytest.CaptureFixture[str]) -> Cli:
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{db_path}",
        secret_key="",
        secret_file=tmp_path / "secret",
    )
    return Cli(settings, capsys)


def test_commands_end_to_end(cli: Cli, db_path: Path, tmp_path: Path) -> None:
    assert cli.ok("migrate")["migrated"] is True

    plan = cli.ok(
        "plans", "create", "--name", "pro", "--rpm", "60", "--tpm", "100000",
        "--max-concurrent", "4", "--budget-usd", "12.345678", "--budget-period", "day",
        "--models", "m1, m2", "--tiers", "economy",
    )  # fmt: skip
    assert plan["budget_micros"] == 12_345_678 and plan["budget_period"] == "day"
    assert plan["allowed_models"] == ["m1", "m2"] and plan["allowed_tiers"] == ["economy"]
    assert (plan["rpm"], plan["tpm"], plan["max_concurrent"]) == (60, 100_000, 4)
    assert (plan["cache_mode"], plan["semantic_threshold"], plan["cache_ttl_s"],
            plan["cache_hit_price_percent"]) == ("auto", None, None, 0)
    assert (plan["engine_weight"], plan["priority"]) == (1.0, 0)
    assert plan["batch_price_percent"] == 50
    free = cli.ok("plans", "create", "--name", "free", "--batch-price-percent", "30")
    assert free["batch_price_percent"] == 30
    assert free["rpm"] is None and free["allowed_models"] is None
    cached = cli.ok(
        "plans", "create", "--name", "cached", "--cache-mode", "semantic",
        "--semantic-threshold", "0.85", "--cache-ttl-s", "600", "--cache-hit-price-percent", "20",
    )  # fmt: skip
    assert (cached["cache_mode"], cached["semantic_threshold"], cached["cache_ttl_s"],
            cached["cache_hit_price_percent"]) == ("semantic", 0.85, 600, 20)
    heavy = cli.ok("plans", "create", "--name", "heavy", "--engine-weight", "2.5",
                   "--priority", "-3", "--embedding-max-request-tokens", "8192")
    assert (heavy["engine_weight"], heavy["priority"]) == (2.5, -3)
    assert heavy["embedding_max_request_tokens"] == 8192
    assert plan["embedding_max_request_tokens"] is None
    listed = cli.ok("plans", "list")
    assert [p["name"] for p in listed] == ["pro", "free", "cached", "heavy"]
    assert (listed[3]["engine_weight"], listed[3]["priority"]) == (2.5, -3)

    tenant = cli.ok("tenants", "create", "--name", "acme", "--plan", "pro")
    assert tenant["plan_id"] == plan["id"] and tenant["status"] == "active"
    assert tenant["semantic_threshold"] is None
    picky = cli.ok("tenants", "create", "--name", "picky", "--plan", "cached",
                   "--semantic-threshold", "0.97")
    assert picky["semantic_threshold"] == 0.97 and picky["plan_id"] == cached["id"]
    assert [t["id"] for t in cli.ok("tenants", "list")] == [tenant["id"], picky["id"]]

    created = cli.ok(
        "keys", "create", "--tenant", tenant["id"], "--name", "ci", "--expires-in-days", "30",
        "--rpm", "5", "--models", "m1", "--adapters", "lora-a,lora-b",
    )  # fmt: skip
    parsed = parse_key(created["key"])
    assert parsed is not None and not parsed.admin and parsed.key_id == created["id"]
    assert created["expires_at"] is not None and created["rpm"] == 5
    assert created["allowed_adapters"] == ["lora-a", "lora-b"]
    assert "secret_hash" not in created

    listed = cli.ok("keys", "list", "--tenant", tenant["id"])
    assert [k["id"] for k in listed] == [created["id"]]
    assert "key" not in listed[0] and "secret_hash" not in listed[0]
    assert parsed.secret not in json.dumps(listed)

    revoked = cli.ok("keys", "revoke", created["id"])
    assert revoked["revoked_at"] is not None
    assert cli.ok("keys", "list", "--tenant", "acme")[0]["revoked_at"] is not None

    assert cli.ok("tenants", "suspend", tenant["id"])["status"] == "suspended"
    assert cli.ok("tenants", "activate", tenant["id"])["status"] == "active"

    admin = cli.ok("admin-keys", "create", "--name", "ops")
    admin_parsed = parse_key(admin["key"])
    assert admin_parsed is not None and admin_parsed.admin
    assert [k["id"] for k in cli.ok("admin-keys", "list")] == [admin["id"]]
    assert cli.ok("admin-keys", "revoke", admin["id"])["revoked_at"] is not None

    # Only a keyed hash is stored: the secrets appear nowhere in the database files.
    pepper = load_or_create_pepper(secret_key="", secret_file=tmp_path / "secret")
    assert stat.S_IMODE(os.stat(tmp_path / "secret").st_mode) == 0o600
    blobs = b"".join(p.read_bytes() for p in tmp_path.glob("switchboard.db*"))
    for secret in (parsed.secret, admin_parsed.secret):
        assert secret.encode() not in blobs
        assert hash_secret(pepper, secret).encode() in blobs


def test_errors_go_to_stderr_with_a_non_zero_exit(cli: Cli) -> None:
    assert "migrate" in cli.fails("plans", "list")  # not migrated yet: a hint, not a traceback
    cli.ok("migrate")
    cli.ok("plans", "create", "--name", "pro")
    assert "already exists" in cli.fails("plans", "create", "--name", "pro")
    assert "no plan" in cli.fails("tenants", "create", "--name", "acme", "--plan", "nope")
    assert "no tenant" in cli.fails("keys", "create", "--tenant", "nope")
    assert "no tenant" in cli.fails("keys", "list", "--tenant", "nope")
    assert "no tenant" in cli.fails("tenants", "suspend", "nope")
    assert "no key" in cli.fails("keys", "revoke", "abcdefgh1234")
    assert "no admin key" in cli.fails("admin-keys", "revoke", "abcdefgh1234")


@pytest.mark.parametrize(
    "argv",
    [
        ["plans", "create", "--name", "x", "--rpm", "-1"],
        ["plans", "create", "--name", "x", "--rpm", "ten"],
        ["plans", "create", "--name", "x", "--budget-usd", "-5"],
        ["plans", "create", "--name", "x", "--budget-usd", "lots"],
        ["plans", "create", "--name", "x", "--budget-period", "week"],
        ["plans", "create", "--name", "x", "--cache-mode", "sometimes"],
        ["plans", "create", "--name", "x", "--semantic-threshold", "0"],
        ["plans", "create", "--name", "x", "--semantic-threshold", "1.5"],
        ["plans", "create", "--name", "x", "--semantic-threshold", "nan"],
        ["plans", "create", "--name", "x", "--cache-ttl-s", "0"],
        ["plans", "create", "--name", "x", "--cache-hit-price-percent", "101"],
        ["plans", "create", "--name", "x", "--engine-weight", "0"],
        ["plans", "create", "--name", "x", "--engine-weight", "-1"],
        ["plans", "create", "--name", "x", "--engine-weight", "101"],
        ["plans", "create", "--name", "x", "--engine-weight", "nan"],
        ["plans", "create", "--name", "x", "--engine-weight", "inf"],
        ["plans", "create", "--name", "x", "--engine-weight", "heavy"],
        ["plans", "create", "--name", "x", "--priority", "11"],
        ["plans", "create", "--name", "x", "--priority", "-11"],
        ["plans", "create", "--name", "x", "--priority", "1.5"],
        ["plans", "create", "--name", "x", "--embedding-max-request-tokens", "0"],
        ["tenants", "create", "--name", "x", "--plan", "p", "--semantic-threshold", "-1"],
        ["keys", "create", "--tenant", "t", "--expires-in-days", "0"],
        ["plans"],
        ["tenants", "create", "--name", "x"],
    ],
)
def test_bad_arguments_are_usage_errors(cli: Cli, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parser.parse_args(argv)
    assert exc.value.code == 2


def test_unreachable_database_is_a_clean_error(tmp_path: Path, capsys) -> None:
    settings = Settings(
        database_url="postgresql+asyncpg://nobody@127.0.0.1:1/none",
        secret_file=tmp_path / "secret",
    )
    cli = Cli(settings, capsys)
    code, out, err = cli.run("plans", "list")
    assert code == 1 and out == "" and err.startswith("error: ")

"""Key format, parsing, keyed hashing and the pepper file."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tenancy.keys import (
    generate_key,
    hash_secret,
    load_or_create_pepper,
    parse_key,
    verify_secret,
)

TENANT_RE = re.compile(r"sk-sb-[a-z0-9]{12}-[0-9a-f]{40}")
ADMIN_RE = re.compile(r"sk-sb-admin-[a-z0-9]{12}-[0-9a-f]{40}")
GOOD_ID = "abcdefgh1234"
GOOD_SECRET = "0123456789abcdef0123456789abcdef01234567"


def test_generated_keys_have_the_documented_shape_and_parse_back() -> None:
    for admin, pattern in ((False, TENANT_RE), (True, ADMIN_RE)):
        key = generate_key(admin=admin)
        assert pattern.fullmatch(key.full)
        assert key.full.endswith(f"{key.key_id}-{key.secret}")
        parsed = parse_key(key.full)
        assert parsed is not None
        assert (parsed.admin, parsed.key_id, parsed.secret) == (admin, key.key_id, key.secret)


def test_generated_keys_are_unique() -> None:
    keys = [generate_key(admin=False) for _ in range(500)]
    assert len({k.key_id for k in keys}) == 500
    assert len({k.secret for k in keys}) == 500


def test_reprs_do_not_leak_the_secret() -> None:
    key = generate_key(admin=False)
    parsed = parse_key(key.full)
    assert key.secret not in repr(key)
    assert key.secret not in repr(parsed)


@pytest.mark.parametrize(
    "token",
    [
        "",
        "sk-sb-",
        f"sk-sb-{GOOD_ID}",
        f"sk-sb-{GOOD_ID}-",
        f"sk-sb-{GOOD_ID}{GOOD_SECRET}",
        f"sk-sb-{GOOD_ID[:-1]}-{GOOD_SECRET}",  # id too short
        f"sk-sb-{GOOD_ID}x-{GOOD_SECRET}",  # id too long
        f"sk-sb-{GOOD_ID.upper()}-{GOOD_SECRET}",  # id must be lowercase
        f"sk-sb-{GOOD_ID}-{GOOD_SECRET.upper()}",  # secret must be lowercase hex
        f"sk-sb-{GOOD_ID}-{GOOD_SECRET[:-1]}",  # secret too short
        f"sk-sb-{GOOD_ID}-{GOOD_SECRET}0",  # secret too long
        f"sk-sb-{GOOD_ID}-{GOOD_SECRET[:-1]}g",  # not hex
        f"sk-sb-{GOOD_ID}-{GOOD_SECRET}\n",
        f" sk-sb-{GOOD_ID}-{GOOD_SECRET}",
        f"Bearer sk-sb-{GOOD_ID}-{GOOD_SECRET}",
        f"sk-SB-{GOOD_ID}-{GOOD_SECRET}",
        f"sk-sb-admin-{GOOD_ID}",
        f"sk-sb-admin-admin-{GOOD_ID}-{GOOD_SECRET}",
        f"sk-sb-{GOOD_ID}-{GOOD_SECRET}-extra",
        f"sk-sb-abcdefgh١٢٣٤-{GOOD_SECRET}",  # non-ASCII digits
        "sk-proj-" + "a" * 48,
        "x" * 10_000,
    ],
)
def test_malformed_tokens_parse_to_none(token: str) -> None:
    assert parse_key(token) is None


@pytest.mark.parametrize("value", [None, b"sk-sb-abc", 123, ["sk-sb-"]])
def test_non_strings_parse_to_none(value: object) -> None:
    assert parse_key(value) is None  # type: ignore[arg-type]


def test_admin_and_tenant_tokens_are_distinguished() -> None:
    tenant = parse_key(f"sk-sb-{GOOD_ID}-{GOOD_SECRET}")
    admin = parse_key(f"sk-sb-admin-{GOOD_ID}-{GOOD_SECRET}")
    assert tenant is not None and not tenant.admin
    assert admin is not None and admin.admin
    assert tenant.key_id == admin.key_id == GOOD_ID


@given(st.text(max_size=200))
def test_parse_never_raises_and_accepts_only_canonical_tokens(token: str) -> None:
    parsed = parse_key(token)
    if parsed is not None:
        prefix = "sk-sb-admin-" if parsed.admin else "sk-sb-"
        assert token == f"{prefix}{parsed.key_id}-{parsed.secret}"


def test_hash_is_keyed_hex_and_not_the_secret() -> None:
    secret = generate_key(admin=False).secret
    digest = hash_secret(b"pepper-a", secret)
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert secret not in digest
    assert digest == hash_secret(b"pepper-a", secret)
    assert digest != hash_secret(b"pepper-b", secret)


def test_verify_secret() -> None:
    secret = generate_key(admin=False).secret
    stored = hash_secret(b"pepper", secret)
    assert verify_secret(b"pepper", secret, stored)
    assert not verify_secret(b"other", secret, stored)
    assert not verify_secret(b"pepper", secret[:-1] + "0" if secret[-1] != "0" else "1", stored)
    assert not verify_secret(b"pepper", secret, "")


def test_pepper_from_setting_wins_and_creates_no_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    assert load_or_create_pepper(secret_key="configured", secret_file=path) == b"configured"
    assert not path.exists()


def test_pepper_file_is_created_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "secret"
    first = load_or_create_pepper(secret_key="", secret_file=path)
    assert re.fullmatch(rb"[0-9a-f]{64}", first)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_pepper(secret_key="", secret_file=path) == first
    assert [p.name for p in path.parent.iterdir()] == ["secret"]  # no temp files left


def test_existing_pepper_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("my-operator-pepper\n")
    assert load_or_create_pepper(secret_key="", secret_file=path) == b"my-operator-pepper"


def test_empty_pepper_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_or_create_pepper(secret_key="", secret_file=path)

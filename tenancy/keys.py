"""API key format, generation, parsing and keyed hashing.

Tenant keys look like `sk-sb-<id>-<secret>`, admin keys `sk-sb-admin-<id>-<secret>`: the id
(12 chars of [a-z0-9]) is public and names the row; the secret (40 hex chars) is shown once
and only its HMAC-SHA256 under a server-side pepper is stored.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import string
from dataclasses import dataclass
from pathlib import Path

KEY_PREFIX = "sk-sb-"
ADMIN_PREFIX = "sk-sb-admin-"
KEY_ID_ALPHABET = string.ascii_lowercase + string.digits
KEY_ID_LENGTH = 12
SECRET_HEX_LENGTH = 40
PEPPER_BYTES = 32

_TOKEN_RE = re.compile(r"sk-sb-(?:(admin)-)?([a-z0-9]{12})-([0-9a-f]{40})")


@dataclass(frozen=True, slots=True)
class GeneratedKey:
    """A new key: its public id, its secret, and the full token shown to the user once."""

    key_id: str
    secret: str
    full: str

    def __repr__(self) -> str:  # never let the secret reach a log through repr()
        return f"GeneratedKey(key_id={self.key_id!r}, secret=***, full=***)"


@dataclass(frozen=True, slots=True)
class ParsedKey:
    """A syntactically valid token split into its parts (not yet checked against storage)."""

    admin: bool
    key_id: str
    secret: str

    def __repr__(self) -> str:
        return f"ParsedKey(admin={self.admin!r}, key_id={self.key_id!r}, secret=***)"


def generate_key(*, admin: bool) -> GeneratedKey:
    """A fresh random key from the `secrets` module (id: ~62 bits, secret: 160 bits)."""
    key_id = "".join(secrets.choice(KEY_ID_ALPHABET) for _ in range(KEY_ID_LENGTH))
    secret = secrets.token_hex(SECRET_HEX_LENGTH // 2)
    prefix = ADMIN_PREFIX if admin else KEY_PREFIX
    return GeneratedKey(key_id=key_id, secret=secret, full=f"{prefix}{key_id}-{secret}")


def parse_key(token: str) -> ParsedKey | None:
    """Split a bearer token into its parts; None for anything malformed. Never raises."""
    if not isinstance(token, str) or len(token) > 128:
        return None
    match = _TOKEN_RE.fullmatch(token)
    if match is None:
        return None
    admin, key_id, secret = match.groups()
    return ParsedKey(admin=admin is not None, key_id=key_id, secret=secret)


def hash_secret(pepper: bytes, secret: str) -> str:
    """HMAC-SHA256 of the secret under the pepper, hex: a stolen DB alone verifies nothing."""
    return hmac.new(pepper, secret.encode("utf-8"), hashlib.sha256).hexdigest()


def verify_secret(pepper: bytes, secret: str, stored_hash: str) -> bool:
    """Constant-time check of a presented secret against the stored hash."""
    return hmac.compare_digest(hash_secret(pepper, secret), stored_hash)


def load_or_create_pepper(*, secret_key: str, secret_file: Path) -> bytes:
    """The HMAC pepper: `secret_key` when set, else the file's content, created on first use.

    The file holds 32 random bytes as hex and is created with mode 0600 (atomically, so
    processes starting together agree on one pepper).
    """
    if secret_key:
        return secret_key.encode("utf-8")
    path = Path(secret_file)
    try:
        return _read_pepper(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(PEPPER_BYTES)
    # Write a private temp file, then hard-link it into place: the link either creates a
    # complete file or fails because another process already did, never a half-written one.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(value + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process won the race: use its pepper
            return _read_pepper(path)
    finally:
        tmp.unlink(missing_ok=True)
    return value.encode("ascii")


def _read_pepper(path: Path) -> bytes:
    value = path.read_text(encoding="utf-8").strip()
    if not value:
        raise ValueError(f"secret file {path} is empty")
    return value.encode("utf-8")

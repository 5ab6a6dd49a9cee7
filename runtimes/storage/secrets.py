"""OpenFaaS secrets: the storage credentials and the invocation token reach a function as mounted files,
never in its package.

The secret `cloudless-storage` holds `NAME=value` lines (for S3, the variables boto3 reads); each
becomes an environment variable unless the platform already set it. The secret `cloudless-token` holds
the deployment's invocation token: a request runs only if it carries that value in the
`X-Cloudless-Token` header (`token_matches`). Neither value is ever logged or returned.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Any

from ...ir.protocol import SECRETS_DIR, STORAGE_SECRET, TOKEN_HEADER, TOKEN_SECRET


def load_openfaas_secret(name: str = STORAGE_SECRET, folder: Path = Path(SECRETS_DIR)) -> list[str]:
    """Set the secret's variables in the environment; returns their names (none if not mounted)."""
    path = folder / name
    if not path.is_file():
        return []
    names = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        os.environ.setdefault(key.strip(), value.strip())
        names.append(key.strip())
    return names


def read_token(name: str = TOKEN_SECRET, folder: Path = Path(SECRETS_DIR)) -> bytes | None:
    """The token in the secret `name` (surrounding whitespace removed: a file made with `--from-file` ends
    with a newline); None if the secret is not mounted or empty."""
    try:
        token = (folder / name).read_bytes().strip()
    except OSError:
        return None
    return token or None


def header(headers: Any, name: str) -> str | None:
    """A request header's value by case-insensitive name, from the template's headers (werkzeug's, which
    look names up case-insensitively) or a plain mapping; None if absent."""
    if headers is None:
        return None
    try:
        value = headers.get(name)
        if value is None:
            value = next((v for k, v in headers.items() if str(k).lower() == name.lower()), None)
    except (AttributeError, TypeError):
        return None
    return value if isinstance(value, str) else None


def token_matches(headers: Any, folder: Path = Path(SECRETS_DIR)) -> bool:
    """Whether a request carries the deployment's token in its `X-Cloudless-Token` header, compared in
    constant time. Never when the secret is not mounted or is empty: a function without a token refuses
    every request rather than accepting any."""
    expected = read_token(folder=folder)
    given = header(headers, TOKEN_HEADER)
    if expected is None or given is None:
        return False
    return hmac.compare_digest(given.strip().encode("utf-8", "replace"), expected)

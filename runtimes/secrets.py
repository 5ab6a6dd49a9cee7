"""OpenFaaS secrets: the storage credentials reach a function as a mounted file, never in its package.

The secret `cloudless-storage` holds `NAME=value` lines (for S3, the variables boto3 reads); each
becomes an environment variable unless the platform already set it.
"""

from __future__ import annotations

import os
from pathlib import Path

from cloudless.ir.protocol import SECRETS_DIR, STORAGE_SECRET


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

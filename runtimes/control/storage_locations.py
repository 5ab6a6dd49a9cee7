"""Where a run's storage is: each region's location from --storage (a folder, s3://, redis://), the
folders among them (which the run marks as its own), and how a location is printed (never a password)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from ...ir.workflow import Workflow


def shown(location: str) -> str:
    """A storage location as printed: a password in it (redis://:secret@host) never is."""
    parsed = urlparse(location)
    if parsed.password is None:
        return location
    host = parsed.hostname or ""
    netloc = f"{parsed.username or ''}:***@{host}" + (f":{parsed.port}" if parsed.port else "")
    return parsed._replace(netloc=netloc).geturl()


def _given_storage(workflow: Workflow, given: list[str] | None) -> tuple[list[str], list[str], dict[str, str]]:
    """The storage's region names (ASGD-GA's server too), and --storage's plain locations and REGION=URL
    ones by region; ValueError for a REGION=URL of no region of the workflow, or an empty location."""
    names = [r.name for r in workflow.regions]
    if len(names) > 1 and workflow.sync.server and workflow.sync.server not in names:
        names.append(workflow.sync.server)
    plain = [g for g in given or () if g.split("=", 1)[0] not in names]
    named = dict(g.split("=", 1) for g in given or () if g.split("=", 1)[0] in names)
    for g in plain:
        head, equals, _ = g.partition("=")
        if equals and head and "/" not in head and ":" not in head:  # REGION=URL of an unknown region
            raise ValueError(f"--storage {g}: no region {head!r} in the workflow; it has {', '.join(names)}")
    for g in given or ():
        location = g if g in plain else g.split("=", 1)[1]
        if not location.strip() or location.strip() == "file://":  # '' would be the current folder
            raise ValueError(
                f"--storage {g or repr(g)}: empty; expected a folder, s3://bucket/prefix or redis://host:port/db"
            )
    if len(plain) > 1:
        raise ValueError(f"--storage: {len(plain)} plain locations; give one, or REGION=URL per region")
    return names, plain, named


def storage_locations(workflow: Workflow, given: list[str] | None, out: Path) -> dict[str, str]:
    """Per region (and ASGD-GA's server) its storage location, from --storage (see its help);
    ValueError for a REGION=URL of no region of the workflow, or an empty location."""
    names, plain, named = _given_storage(workflow, given)
    named = {name: _absolute(location) for name, location in named.items()}
    base = _absolute(plain[0]) if plain else str((out / "storage").resolve())
    if len(names) == 1:
        return {names[0]: named.get(names[0], base)}
    return {name: named.get(name) or region_location(base, name) for name in names}


def _absolute(location: str) -> str:
    """A folder as an absolute path: the functions run in their own folders, where a relative one is another."""
    folder = local_folder(location)
    if folder is None:
        return location
    return f"file://{folder.resolve()}" if location.startswith("file:") else str(folder.resolve())


def local_folder(location: str) -> Path | None:
    """The folder a storage location names (a path, or file://PATH); None for s3:// and redis://."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(parsed.path)
    return Path(location) if parsed.scheme == "" else None


def storage_folders(workflow: Workflow, given: list[str] | None, out: Path) -> list[tuple[str, Path, bool]]:
    """The folders the run's storage lives in, each as (how to name it in a message, folder, whether the
    user named it): each folder --storage gives (a plain one holds every region under it), and OUT/storage
    when a region's storage is the default. Each is marked (STORAGE_MARKER) as Cloudless's."""
    names, plain, named = _given_storage(workflow, given)
    folders = [
        (f"--storage {text}", folder, True)
        for text, location in [(g, g) for g in plain] + [(f"{n}={u}", u) for n, u in named.items()]
        if (folder := local_folder(location)) is not None
    ]
    if not plain and any(not named.get(name) for name in names):
        folders.append((str(out / "storage"), out / "storage", False))
    return folders


def region_location(base: str, region: str) -> str:
    """A region's own part of one storage location: a sub-folder, or a sub-prefix of the bucket's
    prefix or of the Redis key prefix (after '#')."""
    parsed = urlparse(base)
    if parsed.scheme in ("redis", "rediss"):
        url, _, prefix = base.partition("#")
        return f"{url}#{prefix.strip('/') + '/' if prefix.strip('/') else ''}{region}"
    return f"{base.rstrip('/')}/{region}"

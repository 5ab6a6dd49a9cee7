"""Which folders a command may write into: the rules `cloudless-compile -o` and `cloudless-run --out` share.

A build replaces its output folder whole, and a run writes over its own files, so either would destroy
whatever else the folder held. A folder is therefore accepted only when it does not exist, is empty,
or carries the marker of an earlier output of the same kind (`cloudless-build.json`, written into
every build; `cloudless-run.json`, written by the runner), and never when it is a folder whose loss
would be a disaster whatever it holds: the current folder or one above it, the home folder, the root,
or one holding an input of the command (the model file). A run also holds a lock naming its pid while
it writes, so that neither a second run nor a recompile moves the folder from under it. A storage folder
(`cloudless-run --storage DIR`) follows the same rules, with its own marker (`cloudless-storage.json`):
the run deletes its keys from it at the end, so it must never be a folder of the user's.
(Standard library only, apart from `ir.files` for the build marker.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from .files import BUILD_MARKER, read_manifest

#: the file at the root of every run output folder; its presence lets a later run (or a recompile of the
#: build holding it) know the folder is Cloudless's to write into, or to carry over
RUN_MARKER = "cloudless-run.json"
#: the lock a run holds in its output folder while it writes: the writing process's pid
RUN_LOCK = ".cloudless-run.lock"
#: the file at the root of every storage folder a run used (`--storage DIR`, default OUT/storage): a later
#: run may use the folder again (its staged data, a run to resume)
STORAGE_MARKER = "cloudless-storage.json"

Kind = Literal["build", "run"]
#: how each kind's folder is named on the command line, for the messages
OPTION: dict[Kind, str] = {"build": "-o", "run": "--out"}
_WHAT: dict[Kind, str] = {"build": "a Cloudless build", "run": "a Cloudless run output"}
_MARKER: dict[Kind, str] = {"build": BUILD_MARKER, "run": RUN_MARKER}


class FolderError(ValueError):
    """An output folder the command must not write into: one line naming it and what was expected."""


def check_output_folder(path: Path, kind: Kind, *, protected: Sequence[Path] = ()) -> None:
    """Raise FolderError unless writing a `kind` output into `path` destroys nothing of the user's.

    Accepted: a path that does not exist, an empty folder, an earlier output of the same kind (for a
    build: one holding nothing but the files its marker lists and run output folders, none of them
    being written by a live run). `protected` are the command's inputs: a folder holding one is refused.
    """
    option, shown = OPTION[kind], str(path)
    where = f"{option} {shortened(shown)}"
    try:
        _check_output_folder(path, kind, shown, where, protected)
    except (OSError, RuntimeError) as exc:  # a path too long, a loop of links (RuntimeError before 3.13), EACCES
        raise FolderError(f"{where}: cannot be used: {_reason(exc)}") from None


def shortened(text: str, limit: int = 120) -> str:
    """A path for a one-line message: a very long one by its two ends."""
    return text if len(text) <= limit else f"{text[: limit // 2]}…{text[-limit // 2 :]}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc)
    return "a loop of symbolic links" if "loop" in text.lower() else text


def _check_output_folder(path: Path, kind: Kind, shown: str, where: str, protected: Sequence[Path]) -> None:
    resolved = path.resolve()
    _check_not_precious(resolved, where, protected)
    if resolved.exists() and not resolved.is_dir():
        raise FolderError(f"{where}: is a file; expected a folder (a new one, an empty one, or {_WHAT[kind]})")
    for parent in resolved.parents:
        if parent.exists():
            if not parent.is_dir():
                raise FolderError(f"{where}: {parent} is a file; expected a folder")
            break
    if not resolved.exists() or not any(resolved.iterdir()):
        return
    marker = _MARKER[kind]
    if not (resolved / marker).exists():
        raise FolderError(f"{where}: not empty and not {_WHAT[kind]} (no {marker}); choose a new folder or empty it")
    if kind == "run":
        if not is_run_output(resolved):
            raise FolderError(f"{where}: {marker} is not a Cloudless run marker; choose a new folder or empty it")
        _check_no_active_run(resolved, shown)
        return
    manifest = read_manifest(resolved)
    if manifest is None:
        raise FolderError(f"{where}: {marker} is not a readable build marker; choose a new folder or empty it")
    runs = run_outputs(resolved)
    for run in runs:
        _check_no_active_run(run, os.path.join(shown, run.name))
    stray = _stray_file(resolved, set(manifest) | {BUILD_MARKER}, {run.name for run in runs})
    if stray is not None:
        raise FolderError(f"{where}: {os.path.join(shown, stray)} is not part of the earlier build; move it away")


def check_storage_folder(path: Path, where: str, *, protected: Sequence[Path] = ()) -> None:
    """Raise FolderError (naming `where`, the option as given) unless `path` may hold a run's storage:
    it does not exist, is empty, or carries STORAGE_MARKER (an earlier run used it); never a folder
    `check_output_folder` refuses whatever it holds (the current folder or one above, home, the root,
    one holding an input: `protected`)."""
    try:
        resolved = path.resolve()
        _check_not_precious(resolved, where, protected)
        if resolved.exists() and not resolved.is_dir():
            raise FolderError(
                f"{where}: is a file; expected a folder (a new one, an empty one, or one an earlier run used)"
            )
        for parent in resolved.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise FolderError(f"{where}: {parent} is a file; expected a folder")
                break
        if resolved.is_dir() and any(resolved.iterdir()) and not is_storage_folder(resolved):
            raise FolderError(
                f"{where}: holds files Cloudless did not write; expected a new or empty folder, or one an earlier "
                "run used"
            )
    except OSError as exc:  # a folder that cannot be listed, a path too long
        raise FolderError(f"{where}: cannot be read: {exc.strerror or exc}") from None


def is_storage_folder(folder: Path) -> bool:
    """Whether `folder` carries a readable storage marker."""
    return _marked(folder, STORAGE_MARKER, "cloudless-storage")


def _marked(folder: Path, marker: str, kind: str) -> bool:
    """Whether `folder` holds the marker file `marker` of `kind` (readable JSON saying so)."""
    try:
        document = json.loads((folder / marker).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(document, dict) and document.get("kind") == kind


def write_storage_marker(folder: Path, where: str | None = None) -> None:
    """Mark `folder` (made if missing) as a storage folder Cloudless uses; FolderError naming `where`
    (default: the folder) if it cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not is_storage_folder(folder):
            (folder / STORAGE_MARKER).write_text(
                json.dumps({"kind": "cloudless-storage", "format": 1}, indent=1) + "\n"
            )
    except OSError as exc:
        raise FolderError(
            f"{where or folder}: cannot be written: {exc.strerror or exc}; expected a folder this user may write into"
        ) from None


def _check_not_precious(resolved: Path, where: str, protected: Sequence[Path]) -> None:
    """Folders refused even with a marker: replacing them would take far more than an output with them."""
    if resolved == Path(resolved.anchor):
        raise FolderError(f"{where}: is the filesystem root; choose a new folder")
    cwd = Path.cwd().resolve()
    if resolved == cwd:
        raise FolderError(f"{where}: is the current folder; choose a new folder inside it")
    if resolved in cwd.parents:
        raise FolderError(f"{where}: contains the current folder; choose a new folder")
    try:
        home: Path | None = Path.home().resolve()
    except (RuntimeError, KeyError):  # no HOME and no passwd entry
        home = None
    if home is not None and (resolved == home or resolved in home.parents):
        raise FolderError(f"{where}: is or contains the home folder; choose a new folder")
    for item in protected:
        target = item.resolve()
        if resolved == target:
            raise FolderError(f"{where}: is {item}, an input of this command; choose a new folder")
        if resolved in target.parents:
            raise FolderError(f"{where}: holds {item}, an input of this command; choose a new folder")


def _stray_file(build: Path, listed: set[str], runs: set[str]) -> str | None:
    """The first file (by sorted path, relative to `build`) neither listed nor inside a run output."""
    for folder, dirs, files in os.walk(build):
        here = Path(folder).relative_to(build)
        if here == Path("."):
            dirs[:] = [d for d in dirs if d not in runs]
        # Python's bytecode caches of the build's own modules (a handler run in place) are not the user's
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        # a symbolic link to a folder is not walked into: as an entry of its own it is the user's
        entries = sorted(files + [d for d in dirs if Path(folder, d).is_symlink()])
        dirs[:] = [d for d in dirs if not Path(folder, d).is_symlink()]
        for name in entries:
            relative = (here / name).as_posix()
            if relative not in listed:
                return relative
    return None


def run_outputs(build: Path) -> list[Path]:
    """The top-level folders of `build` that are run outputs (carry RUN_MARKER), by name: a recompile
    carries them over into the new build."""
    if not build.is_dir():
        return []
    return sorted(p for p in build.iterdir() if p.is_dir() and not p.is_symlink() and is_run_output(p))


def is_run_output(folder: Path) -> bool:
    """Whether `folder` carries a readable run marker."""
    return _marked(folder, RUN_MARKER, "cloudless-run")


def write_run_marker(out: Path) -> None:
    """Mark `out` (made if missing) as a run output, so that later runs and recompiles recognise it;
    FolderError if it cannot be written (a read-only mount)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / RUN_MARKER).write_text(json.dumps({"kind": "cloudless-run", "format": 1}, indent=1) + "\n")
    except OSError as exc:
        raise FolderError(f"--out {shortened(str(out))}: cannot be written: {_reason(exc)}") from None


def active_run(out: Path) -> int | None:
    """The pid of the live process whose lock `out` holds; None if none, or the lock is stale or garbled."""
    try:
        pid = int((out / RUN_LOCK).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def _alive(pid: int) -> bool:
    if pid <= 0:  # 0 and negative pids name process groups, not a process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    except OSError:
        return False
    return True


def _check_no_active_run(out: Path, shown: str) -> None:
    pid = active_run(out)
    if pid is not None:
        raise FolderError(f"{shown}: a run (pid {pid}) is writing there; wait for it to end or stop it")


@contextmanager
def run_lock(out: Path) -> Iterator[Path]:
    """Hold `out`'s run lock (made with O_EXCL, holding this pid) for the block; yields the lock's path.

    Raises FolderError if a live process holds it already (this one included: it is not reentrant);
    a stale lock, from a process that has ended, is taken over. The lock is removed on exit, exceptions
    included, unless it no longer names this process.
    """
    out.mkdir(parents=True, exist_ok=True)
    lock = out / RUN_LOCK
    for _attempt in range(3):
        try:
            descriptor = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            _check_no_active_run(out, str(out))
            lock.unlink(missing_ok=True)  # stale: its process has ended
            continue
        with os.fdopen(descriptor, "w") as file:
            file.write(f"{os.getpid()}\n")
        break
    else:
        raise FolderError(f"{out}: could not take the run lock {RUN_LOCK}; another run is starting there")
    try:
        yield lock
    finally:
        try:
            if lock.read_text().strip() == str(os.getpid()):
                lock.unlink()
        except (OSError, ValueError):
            pass  # moved with its folder, or removed already

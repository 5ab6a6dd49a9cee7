"""Errors a user sees: one line naming the file (and line) and what was expected."""

from __future__ import annotations

import linecache
import os
import traceback
from pathlib import Path


class CompileError(Exception):
    """A failure the CLI reports as one message and an exit status, never as a traceback."""

    exit_code = 2


class ModelFileError(CompileError):
    """The model file is missing, broken, or does not follow the contract."""


class TraceFailure(CompileError):
    """Neither torch.fx nor torch.export could trace the model."""


class VerificationError(CompileError):
    """The split stages do not reproduce the unsplit model within tolerance."""

    exit_code = 1


_LIBRARY_MARKERS = (
    f"{os.sep}site-packages{os.sep}",
    f"{os.sep}dist-packages{os.sep}",
    f"{os.sep}lib{os.sep}python",
)


def user_frame(exc: BaseException, prefer: Path | None = None) -> traceback.FrameSummary | None:
    """The innermost traceback frame in `prefer` (the model file, or its folder), else in any
    non-library file.

    That is the line a user can act on, rather than the torch internals below it.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    if prefer is not None:
        wanted = str(prefer.resolve())
        folder = prefer.is_dir()
        matching = [
            f
            for f in frames
            if _resolved(f.filename) == wanted
            or folder
            and _resolved(f.filename).startswith(wanted + "/")
            and not any(m in f.filename for m in _LIBRARY_MARKERS)
        ]
        if matching:
            return matching[-1]
    own = str(Path(__file__).resolve().parent.parent)
    candidates = [
        f
        for f in frames
        if not any(m in f.filename for m in _LIBRARY_MARKERS)
        and not _resolved(f.filename).startswith(own)
        and not f.filename.startswith("<")
    ]
    return candidates[-1] if candidates else None


def _resolved(filename: str) -> str:
    try:
        return str(Path(filename).resolve())
    except OSError:
        return filename


def frame_location(frame: traceback.FrameSummary) -> str:
    """`file:line` with the file shown relative to the working directory where possible."""
    return f"{display_path(Path(frame.filename))}:{frame.lineno}"


def frame_source(frame: traceback.FrameSummary) -> str:
    return (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()


#: the input files the user named on the command line, resolved -> as typed: every message names them so
_TYPED: dict[str, str] = {}


def name_as_typed(path: Path) -> None:
    """Name `path` in every later message as it is written here (the command line's spelling)."""
    _TYPED[_resolved(str(path))] = str(path)


def display_path(path: Path) -> str:
    """A path for a message: an input file as the user typed it (`name_as_typed`), else relative to
    the working directory where possible."""
    typed = _TYPED.get(_resolved(str(path)))
    if typed is not None:
        return typed
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def describe(exc: BaseException) -> str:
    """`ExceptionType: first line of the message`."""
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__

"""Output folders (ir/folders.py): `-o` and `--out` never destroy a user's files, and a recompile keeps
the runs a build holds. Most rules are checked on `check_output_folder` directly; the CLI's refusals
come before any pass, so only the tests of a real recompile pay for compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from cloudless.compiler.build import write_build
from cloudless.ir.files import BUILD_MARKER, build_manifest, read_manifest
from cloudless.ir.folders import (
    RUN_LOCK,
    RUN_MARKER,
    FolderError,
    Kind,
    active_run,
    check_output_folder,
    is_run_output,
    run_lock,
    run_outputs,
    write_run_marker,
)

from .conftest import SAMPLES

MLP = SAMPLES / "mlp_digits.py"
CompileCli = Callable[..., tuple[int, str, str]]


def listing(folder: Path) -> dict[str, bytes | None]:
    """Every entry under `folder` (folders as None), to compare a tree before and after."""
    return {
        p.relative_to(folder).as_posix(): (None if p.is_dir() else p.read_bytes()) for p in sorted(folder.rglob("*"))
    }


def fake_build(folder: Path, files: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """An earlier build without a compile: its files and the marker listing them."""
    files = files if files is not None else {"plan.json": b"{}\n", "ir/graph.json": b"{}\n"}
    for path, data in {**files, BUILD_MARKER: build_manifest(files)}.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data)
    return files


def dead_pid() -> int:
    """The pid of a process that has ended (a lock holding it is stale)."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def refused(path: Path, kind: Kind = "build", protected: Sequence[Path] = ()) -> str:
    """The one-line message check_output_folder refuses `path` with."""
    with pytest.raises(FolderError) as info:
        check_output_folder(path, kind, protected=protected)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- check_output_folder --------------------------------------------------------------------------


def test_a_new_an_empty_folder_and_an_earlier_build_are_accepted(tmp_path: Path) -> None:
    check_output_folder(tmp_path / "new" / "deeper", "build")
    (tmp_path / "empty").mkdir()
    check_output_folder(tmp_path / "empty", "build")
    fake_build(tmp_path / "build")
    check_output_folder(tmp_path / "build", "build")


def test_a_folder_with_a_users_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    path = tmp_path / "mine"
    assert refused(path) == (
        f"-o {path}: not empty and not a Cloudless build (no {BUILD_MARKER}); choose a new folder or empty it"
    )
    assert refused(path, "run").startswith(f"--out {path}: not empty and not a Cloudless run output (no {RUN_MARKER})")


def test_an_unreadable_marker_is_not_a_build(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / BUILD_MARKER).write_text("not json")
    assert "not a readable build marker" in refused(tmp_path / "b")


def test_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    assert "is a file" in refused(tmp_path / "notes.txt")
    assert "is a file" in refused(tmp_path / "notes.txt" / "build")


def test_the_current_folder_and_its_parents_are_refused_even_as_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    fake_build(project)  # a marker does not make the current folder expendable
    monkeypatch.chdir(project)
    assert refused(Path(".")) == "-o .: is the current folder; choose a new folder inside it"
    assert "contains the current folder" in refused(Path(".."))
    assert "contains the current folder" in refused(tmp_path)


def test_home_and_root_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home" / "me"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    assert "home folder" in refused(home)
    assert "home folder" in refused(home.parent)
    assert "filesystem root" in refused(Path("/"))
    assert "filesystem root" in refused(Path("/"), "run")
    check_output_folder(home / "build", "build")  # inside it is fine


def test_a_folder_holding_a_protected_input_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "project" / "model.py"
    model.parent.mkdir()
    model.write_text("")
    fake_build(tmp_path / "project", {})  # even with a marker
    assert refused(tmp_path / "project", protected=[model]) == (
        f"-o {tmp_path / 'project'}: holds {model}, an input of this command; choose a new folder"
    )
    assert "an input of this command" in refused(model, protected=[model])
    # symbolic links are resolved before comparing
    (tmp_path / "link").symlink_to(tmp_path / "project")
    assert "an input of this command" in refused(tmp_path / "link", protected=[model])
    check_output_folder(tmp_path / "project" / "build", "build", protected=[model])


def test_a_path_the_system_cannot_use_is_one_line(tmp_path: Path) -> None:
    """A loop of links, a name longer than the file system takes: the option and why, shortened."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert refused(tmp_path / "a") == f"-o {tmp_path / 'a'}: cannot be used: a loop of symbolic links"
    assert refused(tmp_path / "a" / "out", "run").endswith(": cannot be used: a loop of symbolic links")
    long = tmp_path / ("x" * 4500)
    message = refused(long, "run")
    assert message.startswith("--out ") and message.endswith(": cannot be used: File name too long")
    assert "…" in message and len(message) < 200


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """A tmpfs mounted with the given options (a real read-only or full folder); skipped where this process
    may not mount one."""
    mounted: list[Path] = []

    def make(options: str) -> Path:
        folder = tmp_path / f"mount{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_read_only_or_full_folder_is_one_line_and_leaves_nothing(mount: Callable[[str], Path]) -> None:
    read_only = mount("ro,size=1m")
    with pytest.raises(FolderError, match=r"^-o .*/b: cannot be written: Read-only file system$"):
        write_build({"plan.json": b"{}\n"}, read_only / "b")
    with pytest.raises(FolderError, match=r"^--out .*/out: cannot be written: Read-only file system$"):
        write_run_marker(read_only / "out")
    full = mount("size=64k")
    with pytest.raises(FolderError, match=r"^-o .*/b: the build could not be written: No space left on device$"):
        write_build({"plan.json": b"{}\n", "weights.safetensors": bytes(1 << 20)}, full / "b")
    assert list(full.iterdir()) == []  # no half-written build, no staging folder


def test_a_stray_file_in_an_earlier_build_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fake_build(tmp_path / "build")
    write_run_marker(tmp_path / "build" / "run")
    (tmp_path / "build" / "run" / "metrics.json").write_text("{}")  # a run output's files are not stray
    check_output_folder(Path("build"), "build")
    (tmp_path / "build" / "ir" / "notes.txt").write_text("mine")
    assert refused(Path("build")) == "-o build: build/ir/notes.txt is not part of the earlier build; move it away"
    (tmp_path / "build" / "ir" / "notes.txt").unlink()
    (tmp_path / "build" / "stray").symlink_to(tmp_path)  # a link to a folder is an entry, not walked into
    assert "build/stray is not part" in refused(Path("build"))


def test_a_run_output_is_accepted_by_a_run_unless_a_run_is_writing_there(tmp_path: Path) -> None:
    out = tmp_path / "run"
    write_run_marker(out)
    assert is_run_output(out) and json.loads((out / RUN_MARKER).read_text())["kind"] == "cloudless-run"
    (out / "metrics.json").write_text("{}")
    check_output_folder(out, "run")
    assert "not a Cloudless build" in refused(tmp_path / "run", "build")  # a run output is not a build
    (out / RUN_LOCK).write_text(f"{os.getpid()}\n")
    assert refused(out, "run") == f"{out}: a run (pid {os.getpid()}) is writing there; wait for it to end or stop it"
    (out / RUN_LOCK).write_text(f"{dead_pid()}\n")
    check_output_folder(out, "run")


def test_a_build_is_refused_while_a_run_writes_in_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fake_build(tmp_path / "build")
    write_run_marker(tmp_path / "build" / "run")
    (tmp_path / "build" / "run" / RUN_LOCK).write_text(f"{os.getpid()}\n")
    assert refused(Path("build")) == (
        f"build/run: a run (pid {os.getpid()}) is writing there; wait for it to end or stop it"
    )
    (tmp_path / "build" / "run" / RUN_LOCK).write_text(f"{dead_pid()}\n")
    check_output_folder(Path("build"), "build")


# --- the run lock ---------------------------------------------------------------------------------


def test_the_run_lock_holds_the_pid_and_goes_away_on_exit(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert active_run(out) is None
    with run_lock(out) as lock:
        assert lock == out / RUN_LOCK and lock.read_text().strip() == str(os.getpid())
        assert active_run(out) == os.getpid()
        with pytest.raises(FolderError, match="is writing there"), run_lock(out):
            pass  # not reentrant: a second writer is refused
        assert lock.exists()
    assert not lock.exists() and active_run(out) is None
    with pytest.raises(RuntimeError), run_lock(out):
        raise RuntimeError("the run failed")
    assert not (out / RUN_LOCK).exists()


def test_a_stale_or_garbled_lock_is_not_a_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    for content in (f"{dead_pid()}\n", "garbage", "0", "-1", ""):
        (out / RUN_LOCK).write_text(content)
        assert active_run(out) is None, content
    (out / RUN_LOCK).write_text(f"{dead_pid()}\n")
    with run_lock(out) as lock:  # a stale lock is taken over
        assert lock.read_text().strip() == str(os.getpid())
    assert not (out / RUN_LOCK).exists()


def test_the_runners_wiring(tmp_path: Path) -> None:
    """What `cloudless-run --out` does: check, mark, lock; then a second run there is refused."""
    build = tmp_path / "build"
    fake_build(build)
    out = build / "run"
    check_output_folder(out, "run", protected=[build])
    write_run_marker(out)
    with run_lock(out):
        (out / "metrics.json").write_text("{}")
        assert "is writing there" in refused(out, "run", protected=[build])
        assert "is writing there" in refused(build)
    check_output_folder(out, "run", protected=[build])  # the next run
    assert "an input of this command" in refused(build, "run", protected=[build])


# --- write_build ----------------------------------------------------------------------------------


def test_write_build_carries_run_outputs_over_and_takes_over_a_stale_lock(tmp_path: Path) -> None:
    build = tmp_path / "build"
    fake_build(build, {"old.txt": b"old\n", "ir/graph.json": b"{}\n"})
    for name in ("run", "my-run"):
        write_run_marker(build / name)
        (build / name / "storage").mkdir()
        (build / name / "storage" / "blob").write_bytes(b"state")
    (build / "run" / RUN_LOCK).write_text(f"{dead_pid()}\n")
    files = {"ir/graph.json": b"{ }\n", "plan.json": b"{}\n"}
    write_build({**files, BUILD_MARKER: build_manifest(files)}, build)
    assert set(read_manifest(build) or {}) == set(files)
    assert not (build / "old.txt").exists() and (build / "ir" / "graph.json").read_bytes() == b"{ }\n"
    assert run_outputs(build) == [build / "my-run", build / "run"]
    for name in ("run", "my-run"):
        assert (build / name / "storage" / "blob").read_bytes() == b"state"
        assert not (build / name / RUN_LOCK).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build"]  # no staging or retired folder left


def test_write_build_refuses_a_live_run_and_a_run_in_the_builds_way(tmp_path: Path) -> None:
    build = tmp_path / "build"
    fake_build(build)
    write_run_marker(build / "run")
    (build / "run" / RUN_LOCK).write_text(f"{os.getpid()}\n")
    before = listing(tmp_path)
    files = {"plan.json": b"{}\n"}
    with pytest.raises(FolderError, match=r"a run \(pid \d+\) is writing there"):
        write_build(files, build)
    assert listing(tmp_path) == before
    (build / "run" / RUN_LOCK).unlink()
    write_run_marker(build / "ir")  # a --out where the build writes ir/
    before = listing(tmp_path)
    with pytest.raises(FolderError, match=r"build/ir holds a run's output where the new build writes"):
        write_build({"ir/graph.json": b"{}\n"}, build)
    assert listing(tmp_path) == before


def test_a_failed_check_keeps_the_earlier_build_and_its_runs(tmp_path: Path) -> None:
    build = tmp_path / "build"
    fake_build(build)
    write_run_marker(build / "run")
    (build / "run" / "model.safetensors").write_bytes(b"trained")
    before = listing(tmp_path)

    def check(staging: Path) -> None:
        raise RuntimeError("the generated build failed its check")

    with pytest.raises(RuntimeError):
        write_build({"plan.json": b"{}\n"}, build, check=check)
    assert listing(tmp_path) == before


# --- cloudless-compile ----------------------------------------------------------------------------


def test_compile_refuses_a_folder_with_a_users_file(compile_cli: CompileCli, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    code, _, stderr = compile_cli(str(MLP), "-o", str(tmp_path / "out"), "-q")
    assert code == 2
    assert stderr.strip() == (
        f"cloudless-compile: error: -o {tmp_path / 'out'}: not empty and not a Cloudless build "
        f"(no {BUILD_MARKER}); choose a new folder or empty it"
    )
    assert listing(tmp_path) == {"out": None, "out/notes.txt": b"mine"}


def test_compile_refuses_the_current_folder_and_the_model_files_folder(
    compile_cli: CompileCli, model_file: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = model_file(MLP.read_text())
    (tmp_path / "data.csv").write_text("1,2\n")
    monkeypatch.chdir(tmp_path)
    before = listing(tmp_path)
    code, _, stderr = compile_cli("model.py", "-o", ".", "-q")
    assert code == 2 and stderr.strip() == (
        "cloudless-compile: error: -o .: is the current folder; choose a new folder inside it"
    )
    assert listing(tmp_path) == before
    monkeypatch.chdir(tmp_path.parent)
    code, _, stderr = compile_cli(str(model), "-o", str(tmp_path), "-q")
    assert code == 2 and "an input of this command" in stderr
    assert listing(tmp_path) == before


def test_compile_refuses_a_stray_file_in_an_earlier_build_and_a_live_run(
    compile_cli: CompileCli, tmp_path: Path
) -> None:
    build = tmp_path / "build"
    fake_build(build)
    (build / "notes.txt").write_text("mine")
    before = listing(tmp_path)
    code, _, stderr = compile_cli(str(MLP), "-o", str(build), "-q")
    assert code == 2 and f"{build / 'notes.txt'} is not part of the earlier build; move it away" in stderr
    assert listing(tmp_path) == before
    (build / "notes.txt").unlink()
    write_run_marker(build / "run")
    (build / "run" / RUN_LOCK).write_text(f"{os.getpid()}\n")
    before = listing(tmp_path)
    code, _, stderr = compile_cli(str(MLP), "-o", str(build), "-q")
    assert code == 2 and stderr.strip() == (
        f"cloudless-compile: error: {build / 'run'}: a run (pid {os.getpid()}) is writing there; "
        "wait for it to end or stop it"
    )
    assert listing(tmp_path) == before


@pytest.mark.slow
def test_a_recompile_keeps_the_runs_of_the_earlier_build(compile_cli: CompileCli, tmp_path: Path) -> None:
    build = tmp_path / "build"
    assert compile_cli(str(MLP), "-o", str(build), "-q", "--repeats", "1")[0] == 0
    first = read_manifest(build)
    assert first is not None and any(path.endswith("/stack.yaml") for path in first)
    write_run_marker(build / "run")
    (build / "run" / "storage").mkdir()
    (build / "run" / "storage" / "checkpoint").write_bytes(b"weights")
    (build / "run" / "metrics.json").write_text("{}")
    write_run_marker(build / "elsewhere")  # a --out the user put inside the build
    (build / "elsewhere" / RUN_LOCK).write_text(f"{dead_pid()}\n")  # from a run that was killed
    (build / "plan.json").write_text("edited")  # a generated file: replaced

    code, _, stderr = compile_cli(str(MLP), "-o", str(build), "-q", "--repeats", "1", "--target", "sam")
    assert code == 0, stderr
    second = read_manifest(build)
    assert second is not None and not any(path.endswith("/stack.yaml") for path in second)  # SAM only
    assert all((build / path).is_file() for path in second)
    assert not any((build / path).exists() for path in first if path not in second)
    assert (build / "plan.json").read_text() != "edited"
    assert (build / "run" / "storage" / "checkpoint").read_bytes() == b"weights"
    assert (build / "run" / "metrics.json").read_text() == "{}"
    assert is_run_output(build / "elsewhere") and not (build / "elsewhere" / RUN_LOCK).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build"]  # no staging folder left
    check_output_folder(build, "build")  # and it is still a build a later compile accepts

"""Issue 32 item 8: a Redis password never has to be on a command line (the environment or a file gives
it); a symbolic link planted in a storage folder leads no key outside it; a write cut short leaves no
temporary file."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cloudless.ir.protocol import REDIS_PASSWORD_ENV, REDIS_PASSWORD_FILE_ENV, seal
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.storage.channels import DirectoryChannel, StorageRefused, open_channel
from tests.runtime_cases import MLP, front_end, write_packages

PASSWORD = "correct-horse-battery-staple"


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL (db 0, no password in it) of a real redis-server that requires PASSWORD."""
    import redis

    from tests.conftest import _free_port, _stop

    executable = shutil.which("redis-server")
    if executable is None:
        pytest.skip("redis-server is not installed")
    folder = tmp_path_factory.mktemp("locked-redis")
    port = _free_port()
    command = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with (folder / "redis.log").open("wb") as log:
        process = subprocess.Popen(
            [*command, "--dir", str(folder), "--requirepass", PASSWORD], stdout=log, stderr=subprocess.STDOUT
        )
    client = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD)
    try:
        for _ in range(500):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None:
                    pytest.fail(f"redis-server exited:\n{(folder / 'redis.log').read_text()}")
                subprocess.run(["sleep", "0.02"], check=True)
        else:
            pytest.fail("redis-server did not answer PING")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        _stop(process)


@pytest.fixture
def no_password(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(REDIS_PASSWORD_ENV, raising=False)
    monkeypatch.delenv(REDIS_PASSWORD_FILE_ENV, raising=False)
    return monkeypatch


def _refused(location: str) -> str:
    with pytest.raises(StorageRefused) as caught:
        open_channel(location).put("k", b"v")
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_redis_password_comes_from_the_environment_or_a_file(
    locked_redis: str, no_password: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    url = locked_redis
    no_password.setenv(REDIS_PASSWORD_ENV, PASSWORD)
    open_channel(f"{url}#env").put("k", b"from the variable")
    assert open_channel(f"{url}#env").get("k") == b"from the variable"
    no_password.delenv(REDIS_PASSWORD_ENV)
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD + "\n")  # as `echo` writes it
    no_password.setenv(REDIS_PASSWORD_FILE_ENV, str(secret))
    assert open_channel(f"{url}#env").get("k") == b"from the variable"
    # The URL's own password still works, and wins over the environment.
    secret.write_text("not it\n")
    assert open_channel(url.replace("//", f"//:{PASSWORD}@") + "#env").get("k") == b"from the variable"


def test_a_missing_or_wrong_redis_password_is_one_line_without_it(
    locked_redis: str, no_password: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    url = locked_redis
    assert _refused(url) == (
        f"{url}: the server requires a password and none was given: set {REDIS_PASSWORD_ENV}, or "
        f"{REDIS_PASSWORD_FILE_ENV} to a file holding it"
    )
    no_password.setenv(REDIS_PASSWORD_ENV, "wrong-horse")
    message = _refused(url)
    assert message.startswith(f"{url}: the server refused the password in ${REDIS_PASSWORD_ENV}: "), message
    assert "wrong-horse" not in message
    no_password.delenv(REDIS_PASSWORD_ENV)
    secret = tmp_path / "redis-password"
    secret.write_text("wrong-horse\n")
    no_password.setenv(REDIS_PASSWORD_FILE_ENV, str(secret))
    message = _refused(url)
    assert message.startswith(f"{url}: the server refused the password in {REDIS_PASSWORD_FILE_ENV}={secret}: ")
    assert "wrong-horse" not in message
    no_password.setenv(REDIS_PASSWORD_FILE_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(StorageRefused, match=f"^{REDIS_PASSWORD_FILE_ENV}={tmp_path}/nowhere: cannot be read: "):
        open_channel(url)
    no_password.setenv(REDIS_PASSWORD_ENV, PASSWORD)
    with pytest.raises(StorageRefused, match=f"^set {REDIS_PASSWORD_FILE_ENV} or {REDIS_PASSWORD_ENV}, not both$"):
        open_channel(url)


@pytest.fixture(scope="module")
def one_stage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MLP as one function for 2 iterations: a run takes a few seconds."""
    result = front_end()
    n_blocks = len(result.chain.blocks)
    build = tmp_path_factory.mktemp("one_stage") / "build"
    write_packages(result, build, [(0, n_blocks - 1, 1)], micro_batch=8, global_batch=16, iterations=2)
    return build


@pytest.mark.slow
def test_a_run_on_a_locked_redis_takes_its_password_from_the_environment(
    locked_redis: str, one_stage: Path, no_password: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    """The controller and its functions (their environment is the run's) read the password from the file
    the variable names; without it, the run is one line (exit 2) before anything starts."""
    argv = [str(one_stage), "--model", str(MLP), "-q", "--storage", f"{locked_redis}#run"]
    assert run_main([*argv, "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        f"cloudless-run: {locked_redis}: the server requires a password and none was given: set "
        f"{REDIS_PASSWORD_ENV}, or {REDIS_PASSWORD_FILE_ENV} to a file holding it"
    ), err
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD + "\n")
    no_password.setenv(REDIS_PASSWORD_FILE_ENV, str(secret))
    assert run_main([*argv, "--out", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert PASSWORD not in "".join(capsys.readouterr())


# --- symbolic links inside a storage folder ----------------------------------------------------------


def test_a_symbolic_link_in_the_storage_folder_leads_no_key_outside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(seal(b"not the storage's"))
    root = tmp_path / "storage"
    channel = DirectoryChannel(root)
    (root / "run").symlink_to(outside, target_is_directory=True)  # a folder of keys that is a link
    (root / "data").mkdir()
    (root / "data" / "meta").symlink_to(outside / "secret")  # a key that is a link
    for key in ("run/secret", "run/new", "run/deeper/new", "data/meta"):
        with pytest.raises(StorageRefused) as caught:
            channel.try_get(key)
        link = root / key.split("/")[0] if key.startswith("run/") else root / key
        assert str(caught.value) == (
            f"{link}: a symbolic link inside the storage folder {root}; storage never follows one (it would lead "
            "keys outside the folder): remove it"
        )
        for write in (lambda k: channel.put(k, b"escaped"), lambda k: channel.claim(k, b"escaped"), channel.delete):
            with pytest.raises(StorageRefused):
                write(key)
    assert sorted(p.name for p in outside.rglob("*")) == ["secret"]
    assert (outside / "secret").read_bytes() == seal(b"not the storage's")
    # The clean-up neither follows nor removes a link; keys beside the links work as ever.
    channel.put("data/other", b"fine")
    assert channel.get("data/other") == b"fine"
    assert channel.delete_prefix("run/") == 0 and channel.delete_prefix("data/") == 1
    assert (root / "run").is_symlink() and (root / "data" / "meta").is_symlink()
    assert sorted(p.name for p in outside.rglob("*")) == ["secret"]


def test_a_storage_folder_that_is_itself_a_link_is_the_users_choice(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "named").symlink_to(tmp_path / "real", target_is_directory=True)
    channel = DirectoryChannel(tmp_path / "named")
    channel.put("run/k", b"v")
    assert channel.get("run/k") == b"v" and (tmp_path / "real" / "run" / "k").is_file()


# --- a write cut short --------------------------------------------------------------------------------


def _temporary_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".put.")]


def _refuse(*args: object, **kwargs: object) -> None:
    raise OSError(28, "No space left on device")


_fdopen = os.fdopen


def _fdopen_that_cannot_write(fd: int, *args: Any, **kwargs: Any) -> Any:
    handle = _fdopen(fd, *args, **kwargs)
    handle.write = _refuse
    return handle


def test_a_failed_rename_or_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    channel = DirectoryChannel(tmp_path)
    channel.put("run/k", b"old")
    for call, what in (
        (lambda: channel.put("run/k", b"new"), "replace"),
        (lambda: channel.claim("run/new", b"new"), "link"),
        (lambda: channel.put("run/k", b"new"), "fdopen"),
    ):
        with monkeypatch.context() as patched:
            if what == "fdopen":  # the temporary file's own write fails
                patched.setattr(os, "fdopen", _fdopen_that_cannot_write)
            else:
                patched.setattr(os, what, _refuse)
            with pytest.raises(OSError, match="No space left on device"):
                call()
        assert _temporary_files(tmp_path) == [], what
    assert channel.get("run/k") == b"old" and channel.try_get("run/new") is None


def test_a_full_disk_leaves_no_temporary_file(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        channel = DirectoryChannel(disk / "storage")
        channel.put("run/small", b"fits")
        for write in (channel.put, channel.claim):
            with pytest.raises(OSError) as caught:
                write("run/big", bytes(2 << 20))
            assert caught.value.errno == 28  # ENOSPC
            assert _temporary_files(disk) == []
        assert channel.get("run/small") == b"fits" and channel.try_get("run/big") is None
    finally:
        subprocess.run(["umount", str(disk)], check=False)

"""The fault cases of issue 32 (storage refusing writes mid-run, --storage, edited builds, waits, recovery,
configuration, endings, the Redis password), each run as a user runs it: its exit status, seconds and
last line, in a table. For a person reading the endings, not a test (the tests are under tests/).

Run from the repository's root after `bash scripts/setup.sh`, as root (it mounts small tmpfs folders) with
redis-server and redis-cli on PATH: .venv/bin/python scripts/fault_walkthrough.py (about 4 minutes;
it works in /tmp/faults and uses ports 16398-16399)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path.cwd()
BIN = ROOT / ".venv" / "bin"
WORK = Path("/tmp/faults")
shutil.rmtree(WORK, ignore_errors=True)
WORK.mkdir()
BUILD = WORK / "b"
RESULTS: list[tuple[str, int | None, float, str]] = []


def run(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})})


def case(name: str, *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> None:
    began = time.monotonic()
    done = run(*args, cwd=cwd, env=env)
    last = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or [""])[-1]
    RESULTS.append((name, done.returncode, time.monotonic() - began, last[:300]))


def meddled(name: str, storage: str, meddle, *extra: str) -> None:
    """A run of 400 iterations that `meddle(process)` disturbs once it trained 3."""
    command = [
        str(BIN / "cloudless-run"),
        str(BUILD),
        "--iterations",
        "400",
        "--storage",
        storage,
        "--out",
        str(WORK / f"out-{name.replace(' ', '-')}"),
        "--log-every",
        "1",
        *extra,
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert process.stdout is not None
    for line in process.stdout:
        if line.lstrip().startswith("iteration") and int(line.split()[1].split("/")[0]) >= 3:
            break
    began = time.monotonic()
    meddle(process)
    _, stderr = process.communicate(timeout=900)
    last = (stderr.strip().splitlines() or [""])[-1]
    RESULTS.append((name, process.returncode, time.monotonic() - began, last[:300]))


def mount(folder: Path, options: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], check=True)


print("compiling a 3-stage build ...", flush=True)
done = run(str(BIN / "cloudless-compile"), "samples/mlp_digits.py", "--stages", "3", "-o", str(BUILD), "-q")
assert done.returncode == 0, done.stderr

# 1. storage refusing writes mid-run
full = WORK / "full"
mount(full, "size=64m")


def fill(_: object) -> None:
    with (full / "filler").open("wb") as filler:
        try:
            while True:
                filler.write(b"\0" * 2**20)
                filler.flush()
        except OSError:
            pass


meddled("1 full folder mid-run", str(full), fill)
ro = WORK / "ro"
mount(ro, "size=64m")
meddled(
    "1 folder made read-only mid-run",
    str(ro),
    lambda _: subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True),
)
redis_dir = WORK / "redis"
redis_dir.mkdir()
port = 16399
server = subprocess.Popen(
    ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(redis_dir)],
    stdout=subprocess.DEVNULL,
)
time.sleep(1)
meddled(
    "1 redis at maxmemory mid-run",
    f"redis://127.0.0.1:{port}/0",
    lambda _: run("redis-cli", "-p", str(port), "config", "set", "maxmemory", "1"),
)
server.terminate()

# 2. --storage unguarded
mine = WORK / "mine"
mine.mkdir()
(mine / "notes.txt").write_text("mine\n")
case("2 --storage a folder of the user's", str(BIN / "cloudless-run"), str(BUILD), "--storage", str(mine), "-q")
case("2 --storage ''", str(BIN / "cloudless-run"), str(BUILD), "--storage", "", "-q")

# 3. edited builds
edited = WORK / "edited"
shutil.copytree(BUILD, edited)
weights = next(edited.rglob("weights.safetensors"))
data = bytearray(weights.read_bytes())
data[-1] ^= 1
weights.write_bytes(bytes(data))
case("3 a flipped bit in the weights", str(BIN / "cloudless-run"), str(edited), "-q")
shutil.rmtree(edited)
shutil.copytree(BUILD, edited)
with next(edited.rglob("stage.py")).open("a") as stage:
    stage.write("\nprint('appended')\n")
case("3 code appended to stage.py", str(BIN / "cloudless-run"), str(edited), "-q")

# 4. waits: the staged data's wait honours the payload's timeout
package = next(p for p in (BUILD / "regions").glob("*/functions/*-s0"))
case(
    "4 handler payload timeout 2 s, no staged data",
    str(BIN / "python"),
    str(package / "handler.py"),
    json.dumps({"iteration": 0, "stop": 1, "timeout": 2}),
    env={"CLOUDLESS_STORAGE": str(WORK / "empty")},
)


def pause(process: subprocess.Popen[str]) -> None:
    os.kill(process.pid, signal.SIGSTOP)
    time.sleep(30)
    os.kill(process.pid, signal.SIGCONT)


meddled("4 controller paused 30 s (seconds include the pause)", str(WORK / "paused"), pause)
metrics = json.loads((WORK / "out-4-controller-paused-30-s-(seconds-include-the-pause)" / "metrics.json").read_text())
RESULTS.append(("4   its samples/s", None, 0.0, str(metrics["samples_per_s"])))


# 5. recovery: a damaged newest-checkpoint record, a damaged staged shard
def stop_after_checkpoint(process: subprocess.Popen[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        if line.lstrip().startswith("iteration") and int(line.split()[1].split("/")[0]) >= 150:
            break
    process.send_signal(signal.SIGTERM)


meddled("5   (a run stopped after its checkpoint at 100)", str(WORK / "rec"), stop_after_checkpoint, "--run-id", "rec")
latest = next((WORK / "rec" / "rec").rglob("state/s0/latest"))
latest.write_bytes(b"garbage")
case(
    "5 --resume with a damaged state/s0/latest",
    str(BIN / "cloudless-run"),
    str(BUILD),
    "--iterations",
    "400",
    "--storage",
    str(WORK / "rec"),
    "--resume",
    "rec",
    "--out",
    str(WORK / "out-5-stopped-after"),
    "-q",
)
shard = next((WORK / "rec" / "data").rglob("shard-00000"))
damaged = bytearray(shard.read_bytes())
damaged[len(damaged) // 2] ^= 0xFF
shard.write_bytes(bytes(damaged))
began = time.monotonic()
restaged = run(
    str(BIN / "cloudless-run"),
    str(BUILD),
    "--iterations",
    "20",
    "--storage",
    str(WORK / "rec"),
    "--out",
    str(WORK / "out-5b"),
)
RESULTS.append(
    (
        "5 a damaged staged shard",
        restaged.returncode,
        time.monotonic() - began,
        restaged.stdout.strip().splitlines()[-1][:300],
    )
)
RESULTS.append(
    (
        "5   its staging line",
        None,
        0.0,
        next((x for x in restaged.stdout.splitlines() if "stag" in x and "shard" in x), "(none)")[:300],
    )
)

# 8. a Redis password from a file (never on the command line)
secret = WORK / "redis.pass"
secret.write_text("s3cret-pass\n")
locked = subprocess.Popen(
    [
        "redis-server",
        "--port",
        "16398",
        "--save",
        "",
        "--appendonly",
        "no",
        "--requirepass",
        "s3cret-pass",
        "--dir",
        str(redis_dir),
    ],
    stdout=subprocess.DEVNULL,
)
time.sleep(1)
case(
    "8 redis without its password",
    str(BIN / "cloudless-run"),
    str(BUILD),
    "--iterations",
    "5",
    "--storage",
    "redis://127.0.0.1:16398/0",
    "--out",
    str(WORK / "out-8a"),
)
case(
    "8 redis, password from CLOUDLESS_REDIS_PASSWORD_FILE",
    str(BIN / "cloudless-run"),
    str(BUILD),
    "--iterations",
    "5",
    "--storage",
    "redis://127.0.0.1:16398/0",
    "--out",
    str(WORK / "out-8b"),
    env={"CLOUDLESS_REDIS_PASSWORD_FILE": str(secret)},
)
locked.terminate()

# 6. silently wrong configuration
catalog = WORK / "catalog.yaml"
text = (ROOT / "ir" / "catalogs" / "default.yaml").read_text()
lines = text.splitlines(keepends=True)
at = next(i for i, line in enumerate(lines) if line.strip().startswith("gb_second:"))
twice = lines[at].replace(lines[at].split(":", 1)[1], " 1.0\n")  # the same key again, 60,000x the price
catalog.write_text("".join([*lines[: at + 1], twice, *lines[at + 1 :]]))
case(
    "6 a catalog key given twice",
    str(BIN / "cloudless-compile"),
    "samples/mlp_digits.py",
    "--catalog",
    str(catalog),
    "-o",
    str(WORK / "b2"),
    "-q",
)
elsewhere = WORK / "elsewhere"
(elsewhere / "samples").mkdir(parents=True)
(elsewhere / "samples" / "mlp_digits.py").write_text("# another file of that name\n")
case("6 a build run from another folder", str(BIN / "cloudless-run"), str(BUILD), "-q", cwd=elsewhere)

# 7. unclear endings
meddled("7 SIGTERM mid-run", str(WORK / "term"), lambda p: p.send_signal(signal.SIGTERM))
bad = WORK / "exits.py"
bad.write_text("import sys\nsys.exit(3)\n")
case("7 a model file calling sys.exit(3)", str(BIN / "cloudless-compile"), str(bad), "-o", str(WORK / "b3"))
case("7 --bandwidth 1e-300", str(BIN / "cloudless-run"), str(BUILD), "--emulate", "--bandwidth", "1e-300")
case("7 --latency-ms 1e100", str(BIN / "cloudless-run"), str(BUILD), "--emulate", "--latency-ms", "1e100")
(WORK / "loop1").symlink_to(WORK / "loop2")
(WORK / "loop2").symlink_to(WORK / "loop1")
case("7 --out a loop of links", str(BIN / "cloudless-run"), str(BUILD), "--out", str(WORK / "loop1"))
case("7 --out 4,500 characters", str(BIN / "cloudless-run"), str(BUILD), "--out", str(WORK / ("x" * 4500)))
rom = WORK / "rom"
mount(rom, "ro,size=1m")
case("7 --out on a read-only mount", str(BIN / "cloudless-run"), str(BUILD), "--out", str(rom / "out"))
case("7 -o on a read-only mount", str(BIN / "cloudless-compile"), "samples/mlp_digits.py", "-o", str(rom / "b"))
a_file = WORK / "a-file"
a_file.write_text("x")
case("7 --storage a file", str(BIN / "cloudless-run"), str(BUILD), "--storage", str(a_file))

for folder in (full, ro, rom):
    subprocess.run(["umount", "-l", str(folder)], check=False)
print(f"{'case':55} {'exit':>4} {'s':>6}  last line")
for name, code, seconds, last in RESULTS:
    print(f"{name:55} {'' if code is None else code:>4} {seconds:6.1f}  {last}")

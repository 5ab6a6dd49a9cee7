"""Training data where it lies, at scale: the controller's memory and reads, a function's read throughput,
and how much of the reading its prefetch hides behind compute.

A synthetic WebDataset (samples of 100 KB of random bytes and a class, 1,000 to a shard: 100 MB shards,
as `webdataset.ShardWriter` writes them) of the largest size asked for is written once into `--folder`;
each smaller size is its first shards. Then, medians of `--repeats`:

1. **The controller** indexes each size as `cloudless-run` does (`stage_data` of a model file whose
   load_shard names the shards), in a fresh process: its peak RSS and the bytes it read, at 2, 5 and 10 GB.
   Target: the RSS flat as the data grows; bytes read a few KB per sample's files, never the samples.
2. **A function's reads** of 1 GB of the shards (`ShardReader`: each shard read whole, its files sliced by
   the member table of the controller's header scan, or, for a wids-listed split, found by parsing the
   tar's headers) against a plain read of the same bytes (`Path.read_bytes`; in S3, boto3's `get_object`),
   from a folder and from moto's S3 server over HTTP. Target: >= 80% of the plain read's throughput.
3. **Prefetch** over 1 GB: micro-batches of 32 samples read through `ShardBatches` with a transform (the
   bytes as a tensor) and a compute per micro-batch (a matmul of about the read's time per micro-batch),
   prefetching the next micro-batch as the first stage does; the share of the reading thread's time the
   compute hid (1 - waited / read).
4. **Staged data**: a map-style dataset `load_shard` gives (samples of 100 KB of float32 made per index, as
   large as the smallest size asked for) staged by `stage_data` in a fresh process, then read by a first
   stage's reader in another (`open_batches`, 100 micro-batches of 32 in the run's order): each one's peak
   RSS over its imports' (the baseline). Targets: staging within 1 GB however large the data; the reader
   near what the planner counts (`HELD_SHARDS` shards of about 16 MB), not the split.

    python bench/data_bench.py [--sizes 2,5,10] [--repeats 3] [--folder DIR] [--quick]

`--quick` (CI): 0.4 and 1 GB, one repeat.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from cloudless.ir.protocol import S3_ENDPOINT_ENV
from cloudless.ir.sample_order import HELD_SHARDS, SHUFFLE_SHARDS
from cloudless.runtimes.function.batches import ShardBatches
from cloudless.runtimes.storage.objects import S3Objects
from cloudless.runtimes.storage.shards import Members, ShardReader, index_split

SAMPLE_BYTES = 100_000
SAMPLES_PER_SHARD = 1_000
SHARD_BYTES = SAMPLE_BYTES * SAMPLES_PER_SHARD
MICRO_BATCH = 32

#: run in a fresh process: index the shards as cloudless-run does, print peak RSS and what was read
CONTROLLER = """
import json, resource, sys
from pathlib import Path
from cloudless.runtimes.control.staging import stage_data
from cloudless.runtimes.storage.channels import DirectoryChannel

staged = stage_data(DirectoryChannel(Path(sys.argv[2])), "aws-us-east-1", Path(sys.argv[1]))
print(json.dumps({"samples": staged["train"], "read": staged["reason"].get("train", ""),
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""
_PEAK = """
def memory_mb(field):
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) / 1024


def reset_peak():
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from now on
"""
#: a fresh process staging a map-style dataset of `samples` (argv 1, 2: model file, storage)
STAGER = (
    """
import json, sys, time
from pathlib import Path
import cloudless.runtimes.control.staging as staging
from cloudless.runtimes.storage.channels import DirectoryChannel
"""
    + _PEAK
    + """
reset_peak()
base = memory_mb("VmRSS")
began = time.perf_counter()
staged = staging.stage_data(DirectoryChannel(Path(sys.argv[2])), "aws-us-east-1", Path(sys.argv[1]))
print(json.dumps({"samples": staged["train"], "seconds": time.perf_counter() - began, "base_mb": base,
                  "rss_mb": memory_mb("VmHWM")}))
"""
)
#: a fresh process reading micro-batches of the staged split as a first stage does (argv 1: storage)
STAGED_READER = (
    """
import json, sys
from pathlib import Path
from cloudless.runtimes.function.batches import open_batches
from cloudless.runtimes.function.data import read_meta
from cloudless.runtimes.storage.channels import DirectoryChannel
channel = DirectoryChannel(Path(sys.argv[1]))
meta = read_meta(channel, "aws-us-east-1", "train")
batches = open_batches(channel, meta, "aws-us-east-1", "train", None, seed=0, micro_batch=32, global_batch=32,
                       timeout=60.0)
"""
    + _PEAK
    + """
reset_peak()
base = memory_mb("VmRSS")
for iteration in range(100):
    rows = [batches.transformed(at, batches.read(at)) for at in batches.positions(iteration, 0)]
    inputs, targets = batches.collate(rows)
    batches.prefetch(iteration + 1, 0)
print(json.dumps({"base_mb": base, "rss_mb": memory_mb("VmHWM"),
                  "held": batches.reader.capacity, "shard_samples": meta["shard_samples"], "samples": meta["samples"]}))
"""
)
STAGED_MODEL = """
import torch

SAMPLES = {samples}


class Synthetic(torch.utils.data.Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        return (torch.rand(25_000, generator=generator),), index % 10


def load_shard(region, split):
    return Synthetic() if split == "train" else None
"""
MODEL = """
def load_shard(region, split):
    return {pattern!r} if split == "train" else None


def transform(sample, *, epoch, index):
    raise AssertionError("the controller never transforms")
"""


def write_shards(folder: Path, shards: int) -> None:
    """`shards` shards of the synthetic dataset (those already written are kept)."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(SAMPLE_BYTES + 4096)
    for shard in range(shards):
        path = folder / f"train-{shard:06d}.tar"
        if path.is_file() and path.stat().st_size > SHARD_BYTES:
            continue
        partial = path.with_suffix(".partial")
        with tarfile.open(partial, "w") as tar:
            for row in range(SAMPLES_PER_SHARD):
                offset = (shard * SAMPLES_PER_SHARD + row) % 4096  # every sample's bytes differ
                for extension, data in (("bin", block[offset : offset + SAMPLE_BYTES]), ("cls", b"%d" % (row % 10))):
                    info = tarfile.TarInfo(f"s{shard:06d}_{row:04d}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        partial.replace(path)


def pattern(folder: Path, shards: int) -> str:
    return str(folder / f"train-{{000000..{shards - 1:06d}}}.tar")


def controller(folder: Path, shards: int, work: Path) -> dict:
    model = work / f"index_{shards}.py"
    model.write_text(textwrap.dedent(MODEL.format(pattern=pattern(folder, shards))))
    storage = Path(tempfile.mkdtemp(dir=work))
    done = subprocess.run(
        [sys.executable, "-c", CONTROLLER, str(model), str(storage)], check=True, capture_output=True, text=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def throughput(read: object, locations: list[str]) -> float:
    """MB/s of `read(location)` over the locations, in order."""
    began = time.perf_counter()
    total = sum(read(location) for location in locations)  # type: ignore[operator]
    return total / (time.perf_counter() - began) / 1e6


def ours(entries: list, tables: dict[str, Members] | None = None) -> float:
    """MB/s of a function's ShardReader reading every shard (the sample's bytes counted): with the member
    tables of the controller's header scan (by shard file name: they are the bytes' own), as the functions
    read an indexed split, or (None) parsing each tar's headers, as they read a wids-listed split."""
    members = None if tables is None else (lambda entry: tables[Path(entry.location).name])
    reader = ShardReader(entries, 1, members)
    began = time.perf_counter()
    for shard in range(len(entries)):
        reader.sample(shard, 0)
    reader.close()
    return sum(entry.size for entry in entries) / (time.perf_counter() - began) / 1e6


def prefetch_hidden(entries: list, tables: dict[str, Members]) -> tuple[float, float]:
    """(share of the reading hidden behind compute, read seconds) over the shards' micro-batches."""
    meta = {
        "fingerprint": "bench",
        "shuffle_shards": SHUFFLE_SHARDS,
        "shards": [entry.to_json() for entry in entries],
    }
    data = ShardBatches(
        meta,
        entries,
        lambda sample, *, epoch, index: (torch.frombuffer(bytearray(sample["bin"][:4096]), dtype=torch.uint8),),
        lambda samples: samples,
        seed=0,
        micro_batch=MICRO_BATCH,
        global_batch=MICRO_BATCH,
        members=lambda entry: tables[Path(entry.location).name],
    )
    weight = torch.randn(768, 768)
    # a compute of about the read's time per micro-batch: the shard's read time / its micro-batches
    probe = time.perf_counter()
    data.read(data.positions(0, 0)[0])
    per_batch = (time.perf_counter() - probe) * MICRO_BATCH / SAMPLES_PER_SHARD
    began = time.perf_counter()
    matmuls = 0
    while time.perf_counter() - began < per_batch:
        weight = torch.tanh(weight @ weight * 1e-3)
        matmuls += 1
    data.reader.read_seconds = data.reader.waited_seconds = 0.0
    batches = len(entries) * SAMPLES_PER_SHARD // MICRO_BATCH
    for iteration in range(1, batches):
        for located in data.positions(iteration, 0):
            data.transformed(located, data.read(located))
        data.prefetch(iteration + 1, 0)
        for _ in range(max(1, matmuls)):
            weight = torch.tanh(weight @ weight * 1e-3)
    reader = data.reader
    reader.close()
    return 1 - reader.waited_seconds / max(reader.read_seconds, 1e-9), reader.read_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,5,10", help="dataset sizes in GB (default 2,5,10)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "cloudless-data-bench")
    parser.add_argument("--quick", action="store_true", help="0.4 and 1 GB, one repeat (CI)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats = "0.4,1", 1
    sizes = [float(size) for size in args.sizes.split(",")]
    counts = [max(1, round(size * 1e9 / SHARD_BYTES)) for size in sizes]
    print(f"writing {max(counts)} shards of {SHARD_BYTES / 1e6:.0f} MB into {args.folder} (once) ...", flush=True)
    write_shards(args.folder, max(counts))
    work = Path(tempfile.mkdtemp(prefix="data_bench_"))

    print("\n1. the controller indexing the shards (a fresh process each; medians)")
    print(f"{'data':>8} {'samples':>9} {'peak RSS':>10} {'read':>40}")
    for size, count in zip(sizes, counts, strict=True):
        runs = [controller(args.folder, count, work) for _ in range(args.repeats)]
        rss = statistics.median(run["rss_mb"] for run in runs)
        print(f"{size:>6.1f}GB {runs[0]['samples']:>9,} {rss:>8.0f}MB {runs[0]['read']:>40}")

    subset = min(max(counts), 10)  # 1 GB, or all of the largest size
    index = index_split(pattern(args.folder, subset))
    entries = index.entries
    tables = {Path(location).name: members for location, members in index.members.items()}
    locations = [entry.location for entry in entries]
    print(f"\n2. a function's reads of {subset} shards ({subset * SHARD_BYTES / 1e9:.1f} GB; MB/s, medians)")
    print("        (indexed: sliced by the member tables of the header scan; wids-listed: each tar's headers parsed)")
    folder_plain = statistics.median(
        throughput(lambda location: len(Path(location).read_bytes()), locations) for _ in range(args.repeats)
    )
    ratios = {}
    for kind, given in (("indexed", tables), ("wids-listed", None)):
        folder_ours = statistics.median(ours(entries, given) for _ in range(args.repeats))
        ratio = ratios[f"folder {kind}"] = folder_ours / folder_plain
        print(f"folder  {kind:<12} {folder_ours:8.0f}  plain read {folder_plain:8.0f}  ratio {ratio:.2f}")
    ratios.update(s3_reads(args.folder, entries, tables, args.repeats))

    print(f"\n3. prefetch over {subset} shards, micro-batches of {MICRO_BATCH}, compute ~ the read per micro-batch")
    hidden = [prefetch_hidden(entries, tables) for _ in range(args.repeats)]
    print(f"hidden behind compute: {statistics.median(h for h, _ in hidden):.0%} of "
          f"{statistics.median(r for _, r in hidden):.1f} s of reading")  # fmt: skip
    print("\nratios: " + ", ".join(f"{kind} {ratio:.2f}" for kind, ratio in ratios.items()) + " (target >= 0.80)")

    samples = round(sizes[0] * 1e9 / SAMPLE_BYTES)
    print(f"\n4. staged data: a map-style dataset of {samples:,} samples of 100 KB ({sizes[0]:.1f} GB)")
    staged = [staged_data(samples, work) for _ in range(args.repeats)]
    stage_rss = statistics.median(run["stage"]["rss_mb"] - run["stage"]["base_mb"] for run in staged)
    read_rss = statistics.median(run["read"]["rss_mb"] - run["read"]["base_mb"] for run in staged)
    seconds = statistics.median(run["stage"]["seconds"] for run in staged)
    read = staged[0]["read"]
    counted = HELD_SHARDS * read["shard_samples"] * SAMPLE_BYTES / 2**20
    print(f"staging: {seconds:.0f} s, peak RSS {stage_rss:.0f} MB over its imports (target < 1024 MB)")
    print(f"a first stage's reads of 100 micro-batches: peak RSS {read_rss:.0f} MB over its imports; the planner "
          f"counts {HELD_SHARDS} shards of {read['shard_samples']:,} samples ({counted:.0f} MB), the split is "
          f"{read['samples'] * SAMPLE_BYTES / 2**20:,.0f} MB")  # fmt: skip
    return 0


def staged_data(samples: int, work: Path) -> dict[str, dict]:
    """Stage a map-style dataset of `samples` in a fresh process, then read it as a first stage in another."""
    model = work / f"staged_{samples}.py"
    model.write_text(textwrap.dedent(STAGED_MODEL.format(samples=samples)))
    storage = Path(tempfile.mkdtemp(dir=work))
    runs = {}
    for name, code, argv in (("stage", STAGER, [str(model), str(storage)]), ("read", STAGED_READER, [str(storage)])):
        done = subprocess.run([sys.executable, "-c", code, *argv], check=True, capture_output=True, text=True)
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return runs


def s3_reads(folder: Path, entries: list, tables: dict[str, Members], repeats: int) -> dict[str, float]:
    """The same shards in moto's S3 over HTTP: ShardReader (with the tables, and parsing) against boto3's
    get_object, MB/s."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        os.environ[S3_ENDPOINT_ENV] = endpoint
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="data-bench")
        for entry in entries:
            s3.upload_file(entry.location, "data-bench", Path(entry.location).name)
        # the counts from a wids index (a header scan over HTTP is four requests per sample: minutes)
        shardlist = [{"url": Path(e.location).name, "nsamples": e.samples} for e in entries]
        s3.put_object(Bucket="data-bench", Key="train.json", Body=json.dumps({"shardlist": shardlist}).encode())
        remote = "s3://data-bench/train.json"
        import cloudless.runtimes.storage.shards as shards

        store, folder_store = S3Objects(), shards.store_for
        shards.store_for = lambda location: store  # type: ignore[assignment]  # one client, as a function has
        try:
            indexed = index_split(remote).entries
            mine = {
                kind: statistics.median(ours(indexed, given) for _ in range(repeats))
                for kind, given in (("indexed", tables), ("wids-listed", None))
            }
        finally:
            shards.store_for = folder_store
        names = [Path(entry.location).name for entry in entries]
        plain = statistics.median(
            throughput(lambda key: len(s3.get_object(Bucket="data-bench", Key=key)["Body"].read()), names)
            for _ in range(repeats)
        )
        for kind, speed in mine.items():
            print(f"S3      {kind:<12} {speed:8.0f}  boto3 get  {plain:8.0f}  ratio {speed / plain:.2f}")
        return {f"S3 {kind}": speed / plain for kind, speed in mine.items()}
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())

"""WebDataset shards where they lie (a folder, moto's S3 over HTTP): indexed from their tar headers alone,
read whole as `webdataset` itself reads them, and refused with the shard named when missing, changed or
damaged."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import boto3
import pytest
import webdataset

from cloudless.ir.protocol import S3_ENDPOINT_ENV
from cloudless.runtimes.storage.objects import ObjectError, S3Objects, store_for
from cloudless.runtimes.storage.shards import (
    ShardEntry,
    ShardError,
    ShardReader,
    index_split,
    read_shard,
    shard_locations,
)

COUNTS = (7, 3, 5)


def write_shards(folder: Path, counts: tuple[int, ...] = COUNTS) -> str:
    """Shards as webdataset's ShardWriter writes them: a payload of a few KB and a class per sample."""
    folder.mkdir(parents=True, exist_ok=True)
    with webdataset.ShardWriter(str(folder / "train-%06d.tar"), maxcount=max(counts), verbose=0) as sink:
        for shard, count in enumerate(counts):
            if shard:
                sink.next_stream()  # a new shard, whatever the count
            for row in range(count):
                sink.write({"__key__": f"s{shard}/{row:04d}", "bin": os.urandom(20_000 + row), "cls": row % 10})
    return str(folder / f"train-{{000000..{len(counts) - 1:06d}}}.tar")


def test_braces_expand_in_order() -> None:
    assert shard_locations("s3://b/t-{00..02}.tar") == ["s3://b/t-00.tar", "s3://b/t-01.tar", "s3://b/t-02.tar"]
    assert shard_locations(["/d/{b,a}.tar", "/d/c.tar"]) == ["/d/b.tar", "/d/a.tar", "/d/c.tar"]


def test_a_folder_of_shards_is_indexed_and_read_as_webdataset_reads_it(tmp_path: Path) -> None:
    pattern = write_shards(tmp_path / "data")
    index = index_split(pattern)
    entries, fingerprint = index.entries, index.fingerprint
    assert [e.samples for e in entries] == list(COUNTS)
    assert fingerprint.startswith("sha256:") and index_split(pattern).fingerprint == fingerprint
    ours = [sample for entry in entries for sample in read_shard(store_for(entry.location), entry)]
    theirs = list(webdataset.WebDataset(pattern, shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in ours] == [s["__key__"] for s in theirs]
    assert all(a["bin"] == b["bin"] and a["cls"] == b["cls"] for a, b in zip(ours, theirs, strict=True))
    # the member tables of the header scan slice the same files from the shards' bytes, without parsing them
    assert sorted(index.members) == [e.location for e in entries]
    sliced = [s for e in entries for s in read_shard(store_for(e.location), e, index.members[e.location])]
    assert sliced == ours
    reader = ShardReader(entries, 1, members=lambda entry: index.members[entry.location])
    assert reader.sample(2, 4) == ours[sum(COUNTS[:2]) + 4]
    # a table that does not fit the shard (a file cut short) names the file
    cut = [
        (name, at, size + 10**6) if n == 3 else (name, at, size)
        for n, (name, at, size) in enumerate(index.members[entries[1].location])
    ]
    with pytest.raises(
        ShardError, match=r"train-000001\.tar: s1/0001\.cls: \d+ of its \d+ bytes in the tar \(cut short\)"
    ):
        read_shard(store_for(entries[1].location), entries[1], cut)
    # reused entries are not scanned again: no tables
    assert index_split(pattern, entries).members == {}
    # written again: the fingerprint changes, and a reader at the old version refuses it
    first = entries[0].location
    data = Path(first).read_bytes()
    Path(first).write_bytes(data)
    os.utime(first, ns=(1, 1))
    assert index_split(pattern, entries).fingerprint != fingerprint
    with pytest.raises(ObjectError, match="changed since it was indexed"):
        ShardReader(entries, 2).sample(0, 0)


def test_s3_shards_are_indexed_from_their_headers_and_the_index_reused(
    tmp_path: Path, s3_bucket: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(S3_ENDPOINT_ENV, moto_endpoint)
    write_shards(tmp_path / "data")
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    for path in sorted((tmp_path / "data").iterdir()):
        s3.upload_file(str(path), s3_bucket, f"corpus/{path.name}")
    pattern = f"s3://{s3_bucket}/corpus/train-{{000000..000002}}.tar"
    store = S3Objects()
    import cloudless.runtimes.storage.shards as shards

    monkeypatch.setattr(shards, "store_for", lambda location: store)
    index = index_split(pattern)
    entries = index.entries
    assert [e.samples for e in entries] == list(COUNTS)
    # one GET a shard, its files read from the stream by the member table, as tarfile finds them
    for entry in entries:
        assert read_shard(store, entry, index.members[entry.location]) == read_shard(store, entry)
    sample_bytes = sum(path.stat().st_size for path in (tmp_path / "data").iterdir())
    # headers only: per file a PAX header, its data and the file's header (512 bytes each) and one byte of
    # the file before (tarfile's check that it is whole); the end's two blocks
    headers = store.reads.bytes - 2 * sample_bytes  # the shards read twice above
    assert headers <= (3 * 512 + 1) * 2 * sum(COUNTS) + 1024 * len(COUNTS) < sample_bytes / 5, store.reads
    before = store.reads.requests
    assert index_split(pattern, entries).entries == entries
    assert store.reads.requests - before == len(COUNTS)  # a HEAD per shard, nothing read
    reader = ShardReader(entries, capacity=2)
    assert reader.sample(2, 4)["__key__"] == "s2/0004" and reader.sample(0, 6)["cls"] == b"6"
    reader.sample(1, 0)
    assert reader.held == 2  # the bound
    other = (tmp_path / "data" / "train-000001.tar").read_bytes()
    s3.put_object(Bucket=s3_bucket, Key="corpus/train-000002.tar", Body=other)
    with pytest.raises(ObjectError, match="train-000002.tar: changed since it was indexed"):
        ShardReader(entries, 1).sample(2, 0)
    with pytest.raises(ObjectError, match="corpus/train-000003.tar: no such object"):
        index_split(f"s3://{s3_bucket}/corpus/train-{{000000..000009}}.tar")


def test_a_wids_index_gives_the_counts_without_a_scan(tmp_path: Path) -> None:
    pattern = write_shards(tmp_path / "data")
    shardlist = [{"url": f"train-{n:06d}.tar", "nsamples": c} for n, c in enumerate(COUNTS)]
    (tmp_path / "data" / "index.json").write_text(json.dumps({"wids_version": 1, "shardlist": shardlist}))
    entries = index_split(str(tmp_path / "data" / "index.json")).entries
    assert entries == index_split(pattern).entries
    (tmp_path / "data" / "index.json").write_text(json.dumps({"shards": []}))
    with pytest.raises(ShardError, match="index.json: expected a wids shard index"):
        index_split(str(tmp_path / "data" / "index.json"))


def test_damaged_shards_are_named(tmp_path: Path) -> None:
    pattern = write_shards(tmp_path / "data", (4,))
    (path,) = (tmp_path / "data").iterdir()
    path.write_bytes(path.read_bytes()[:1500])  # cut inside the first sample
    with pytest.raises(ShardError, match="train-000000.tar: not a tar file, or a damaged one"):
        index_split(pattern)
    stat = store_for(str(path)).stat(str(path))  # cut after it was indexed, at the index's version
    with pytest.raises(ShardError, match=r"train-000000.tar: damaged"):
        read_shard(store_for(str(path)), ShardEntry(str(path), 4, stat.size, stat.version))
    path.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(ShardError, match="train-000000.tar: not a tar file"):
        index_split(pattern)
    twice = io.BytesIO()
    with tarfile.open(fileobj=twice, mode="w") as tar:
        for name in ("a.cls", "a.cls"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))
    path.write_bytes(twice.getvalue())
    with pytest.raises(ShardError, match="a second file of sample 'a' with extension 'cls'"):
        index_split(pattern)
    with pytest.raises(ObjectError, match="no such file"):
        index_split(str(tmp_path / "data" / "missing-{0..1}.tar"))
    with pytest.raises(ObjectError, match="expected s3://BUCKET/KEY or an absolute path"):
        index_split("relative/train.tar")


def test_s3_without_credentials_is_one_clear_error(tmp_path: Path, moto_endpoint: str, monkeypatch) -> None:
    monkeypatch.setenv(S3_ENDPOINT_ENV, moto_endpoint)
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # another test's session keeps its credentials
    with pytest.raises(ObjectError, match="s3://b/t.tar: no AWS credentials to read it with"):
        index_split("s3://b/t.tar")


def test_prefetched_shards_are_read_once_in_the_background_within_the_capacity(tmp_path: Path) -> None:
    pattern = write_shards(tmp_path / "data", (2, 2, 2, 2))
    reader = ShardReader(index_split(pattern).entries, capacity=2)
    reader.prefetch([3, 1, 0])  # the first two only: the capacity
    assert reader.held == 2
    assert reader.sample(3, 1)["__key__"] == "s3/0001" and reader.sample(1, 0)["__key__"] == "s1/0000"
    assert reader.store.reads.requests == 2  # read once each, by the prefetch
    reader.sample(0, 0)
    assert reader.held == 2 and reader.store.reads.requests == 3
    reader.close()


def write_parquet(folder: Path) -> str:
    """Two Parquet files as a user's own would be: one written by `datasets` (an Image-like struct column of
    bytes, rows of text), one by pyarrow in row groups of 4."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"text": "x" * (row + 1), "image": {"bytes": os.urandom(20_000), "path": None}, "label": row % 3}
            for row in range(10)]  # fmt: skip
    datasets.Dataset.from_list(rows).to_parquet(str(folder / "part-0.parquet"))
    table = pa.Table.from_pylist([{"text": f"row {row}", "label": row} for row in range(11)])
    pq.write_table(table, folder / "part-1.parquet", row_group_size=4)
    return str(folder / "part-{0,1}.parquet")


def test_parquet_files_are_sharded_by_row_group_from_their_footers_alone(
    tmp_path: Path, s3_bucket: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow.parquet as pq

    pattern = write_parquet(tmp_path / "data")
    index = index_split(pattern)
    assert index.format == "parquet"
    assert [(Path(e.location).name, e.row_group, e.samples) for e in index.entries] == [
        ("part-0.parquet", 0, 10),
        ("part-1.parquet", 0, 4),
        ("part-1.parquet", 1, 4),
        ("part-1.parquet", 2, 3),
    ]
    ours = [row for entry in index.entries for row in read_shard(store_for(entry.location), entry)]
    theirs = [
        row for path in ("part-0", "part-1") for row in pq.read_table(tmp_path / "data" / f"{path}.parquet").to_pylist()
    ]
    assert ours == theirs
    # not both kinds in one split; a file that is not Parquet is named
    with pytest.raises(ShardError, match=r"a.tar: a split's files are all Parquet"):
        index_split([str(tmp_path / "data" / "part-0.parquet"), str(tmp_path / "a.tar")])
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ShardError, match=r"bad.parquet: not a Parquet file, or a damaged one"):
        index_split(str(tmp_path / "bad.parquet"))
    # in S3: the footers only at indexing (pyarrow reads a file's last 64 KB: the whole of a smaller one), and
    # a file written again is refused by its row groups' readers
    monkeypatch.setenv(S3_ENDPOINT_ENV, moto_endpoint)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    for path in sorted((tmp_path / "data").iterdir()):
        s3.upload_file(str(path), s3_bucket, f"pq/{path.name}")
    store = S3Objects()
    import cloudless.runtimes.storage.shards as shards

    monkeypatch.setattr(shards, "store_for", lambda location: store)
    remote = index_split(f"s3://{s3_bucket}/pq/part-{{0,1}}.parquet")
    assert [(e.row_group, e.samples) for e in remote.entries] == [(e.row_group, e.samples) for e in index.entries]
    images = sum(len(row["image"]["bytes"]) for row in ours if row.get("image"))
    assert store.reads.requests == 4 and store.reads.bytes < images / 2, store.reads  # a HEAD and a GET per file
    reader = ShardReader(remote.entries, capacity=2)
    assert reader.sample(2, 1) == {"text": "row 5", "label": 5} and reader.sample(0, 9)["label"] == 0
    s3.put_object(Bucket=s3_bucket, Key="pq/part-1.parquet", Body=(tmp_path / "data" / "part-0.parquet").read_bytes())
    with pytest.raises(ObjectError, match="part-1.parquet: changed since it was indexed"):
        ShardReader(remote.entries, 1).sample(3, 0)

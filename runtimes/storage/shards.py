"""Training data where it lies: WebDataset tar shards or Parquet files in a folder or a bucket, indexed by
the controller and read by the functions.

A split is named by a pattern of shard locations, as `webdataset` names them: braces expand to a list
(`s3://bucket/train-{000000..000099}.tar`, `/data/train-{a,b}.tar`), in that order. A shard is a tar whose
regular files are grouped into samples by WebDataset's conventions (`webdataset.tariterators`): a file's
key is its path up to the first dot of its name, the rest its extension (lower-cased); consecutive files of
one key are one sample, `{"__key__": key, "__url__": shard, ext: bytes, ...}`; names `__...__` are
metadata, skipped.

The controller indexes a split (`index_split`): each shard's size and version, and its sample count from
its tar headers alone (ranged reads of 512-byte blocks; never a sample's bytes). The index is kept with
the run's storage, and reused while every shard's size and version are unchanged. A split named by a
`wids` shard index instead (a `.json` location: `{"shardlist": [{"url": ..., "nsamples": ...}, ...]}`, as
`widsindex create` writes it; a shard's url relative to the index's folder, or to its `base_path`) takes
its counts from there: a header scan costs a request per file, too slow for shards of thousands of samples
in S3.

A split of Parquet files (every location ending `.parquet`, as pyarrow and Hugging Face `datasets` write
them) is sharded by row group: each row group of each file is one shard, its sample count from the file's
footer (pyarrow reads the footer alone, by ranged reads). A sample is a row, `{column: value}` as pyarrow
gives it in Python (a `datasets` Image column: `{"bytes": b"...", "path": ...}`).

A function reads whole shards (`ShardReader`; a Parquet shard's row group is read alone, its column
chunks by ranged reads; Cloudless's staged shards too, by the loader it is given), at most `capacity` of them
held at once, each read at the version the index
recorded: a shard written again since is an error, never a sample of other data.
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...ir.protocol import PARQUET_SUFFIX
from .objects import ObjectError, ObjectReads, ObjectStore, store_for

#: webdataset's `base_plus_ext`: a file name's key and its extensions
_KEY_AND_EXTENSION = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
#: webdataset's metadata files, skipped (`tar_file_iterator`'s skip_meta and its `__...__` names)
_METADATA = re.compile(r"__[^/]*__($|/)")
WEBDATASET, PARQUET = "webdataset", "parquet"
#: the formats of a split's `meta` whose shards lie in place (a staged split's meta has its own)
IN_PLACE_FORMATS = (WEBDATASET, PARQUET)
#: shards indexed at once
INDEX_THREADS = 16
#: the index's fingerprint: of every shard's location, size, version and sample count
FINGERPRINT_PREFIX = "sha256:"

Sample = dict[str, Any]
#: a tar shard's sample files in order: (file name, data offset, size)
Members = list[tuple[str, int, int]]
#: where a reader finds a shard's member table (None: it has none; its headers are parsed)
MemberTables = Callable[["ShardEntry"], "Members | None"]


class ShardError(ValueError):
    """A shard cannot be read as the index says: damaged, changed, or not a tar of samples."""


def in_place_pattern(given: Any, folder: Path) -> str | list[str] | None:
    """What load_shard gave, when it names shards where they lie (a pattern of locations, a list of them, a
    wids index), with locations relative to the model file's `folder` made absolute; None for a dataset."""
    patterns = [given] if isinstance(given, str) else given
    if not (isinstance(patterns, (list, tuple)) and patterns and all(isinstance(p, str) for p in patterns)):
        return None
    absolute = [p if p.startswith("s3://") or Path(p).is_absolute() else str(folder / p) for p in patterns]
    return absolute[0] if isinstance(given, str) else absolute


def shard_locations(pattern: str | Iterable[str]) -> list[str]:
    """The shard locations a pattern (or a list of patterns) names, braces expanded, in order."""
    import braceexpand

    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    locations = [location for each in patterns for location in braceexpand.braceexpand(each)]
    if not locations:
        raise ShardError(f"{pattern!r}: names no shards")
    return locations


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The tar's members that are a sample's files, in order (webdataset's filter)."""
    for info in tar:
        name = info.name
        if not info.isreg() or name is None:
            continue
        if _METADATA.match(name) or ("/" not in name and name.startswith("__") and name.endswith("__")):
            continue
        yield info


def _samples_of(names: Iterable[tuple[str, Any]], location: str) -> Iterator[Sample]:
    """(file name, its data) in tar order grouped into samples, as webdataset's `group_by_keys` groups them."""
    current: Sample | None = None
    for name, data in names:
        matched = _KEY_AND_EXTENSION.match(name)
        if matched is None:
            continue
        key, extension = matched.group(1), matched.group(2).lower()
        if current is None or key != current["__key__"]:
            if current is not None:
                yield current
            current = {"__key__": key, "__url__": location}
        if extension in current:
            raise ShardError(f"{location}: {name}: a second file of sample {key!r} with extension {extension!r}")
        current[extension] = data
    if current is not None:
        yield current


class _RangedReads(io.RawIOBase):
    """An object as a seekable file whose reads are ranged reads of the store: tarfile reads a header's
    blocks and seeks over the member's data, so indexing reads headers only."""

    def __init__(self, store: ObjectStore, location: str, size: int, version: str) -> None:
        self.store, self.location, self.size, self.version, self.position = store, location, size, version, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        wanted = min(len(buffer), self.size - self.position)
        if wanted <= 0:
            return 0
        data = self.store.read(self.location, self.version, self.position, self.position + wanted)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


@dataclass(frozen=True)
class ShardEntry:
    """One shard of a split's index: a tar, or one row group of a Parquet file."""

    location: str
    samples: int
    size: int
    version: str
    row_group: int | None = None

    def to_json(self) -> dict[str, Any]:
        data = {"location": self.location, "samples": self.samples, "size": self.size, "version": self.version}
        return data if self.row_group is None else {**data, "row_group": self.row_group}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardEntry:
        row_group = None if data.get("row_group") is None else int(data["row_group"])
        return cls(str(data["location"]), int(data["samples"]), int(data["size"]), str(data["version"]), row_group)

    @property
    def name(self) -> str:
        return self.location if self.row_group is None else f"{self.location} (row group {self.row_group})"


def split_format(locations: list[str]) -> str:
    """PARQUET when every location names a Parquet file, WEBDATASET when none does."""
    parquet = [location.lower().endswith(PARQUET_SUFFIX) for location in locations]
    if any(parquet) and not all(parquet):
        odd = locations[parquet.index(False)]
        raise ShardError(f"{odd}: a split's files are all Parquet ({PARQUET_SUFFIX}) or all tar shards, not both")
    return PARQUET if all(parquet) else WEBDATASET


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet
    except ImportError:
        raise ShardError("reading Parquet needs pyarrow: pip install pyarrow") from None
    return pyarrow.parquet


def _parquet_file(store: ObjectStore, location: str, size: int, version: str, metadata: Any = None) -> Any:
    parquet = _pyarrow_parquet()
    try:
        return parquet.ParquetFile(_RangedReads(store, location, size, version), metadata=metadata)
    except ObjectError:
        raise
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ShardError(f"{location}: not a Parquet file, or a damaged one: {exc}") from None


def row_group_entries(store: ObjectStore, location: str, size: int, version: str) -> list[ShardEntry]:
    """A Parquet file's row groups as shards, their counts from its footer alone."""
    metadata = _parquet_file(store, location, size, version).metadata
    return [
        ShardEntry(location, metadata.row_group(group).num_rows, size, version, group)
        for group in range(metadata.num_row_groups)
    ]


def scan_members(store: ObjectStore, location: str, size: int, version: str) -> Members:
    """The shard's member table, from its tar headers alone: each sample file's name, data offset and size."""
    try:
        with tarfile.open(fileobj=_RangedReads(store, location, size, version), mode="r:") as tar:
            return [(m.name, m.offset_data, m.size) for m in _members(tar)]
    except tarfile.TarError as exc:
        raise ShardError(f"{location}: not a tar file, or a damaged one: {exc}") from None


def count_samples(location: str, members: Members) -> int:
    """The samples a member table's files make (webdataset's grouping)."""
    return sum(1 for _ in _samples_of(((name, None) for name, _, _ in members), location))


def wids_counts(location: str, store: ObjectStore) -> dict[str, int]:
    """The shards a wids shard index lists, by location, with their sample counts."""
    import json

    try:
        index = json.loads(store.read(location, store.stat(location).version))
        base = str(index.get("base_path") or location.rsplit("/", 1)[0])
        listed = [(str(shard["url"]), int(shard["nsamples"])) for shard in index["shardlist"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ShardError(
            f'{location}: expected a wids shard index, {{"shardlist": [{{"url": ..., "nsamples": N}}, ...]}}: '
            f"{type(exc).__name__}: {exc}"
        ) from None
    absolute = ("s3://", "/")
    return {url if url.startswith(absolute) else f"{base.rstrip('/')}/{url}": count for url, count in listed}


@dataclass(frozen=True)
class SplitIndex:
    """A split's shards with their counts, their format, the index's fingerprint, and what indexing read."""

    entries: list[ShardEntry]
    fingerprint: str
    reads: ObjectReads
    format: str = WEBDATASET
    #: the member tables of the tar shards this indexing scanned, by location (not those known or listed)
    members: dict[str, Members] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return sum(entry.samples for entry in self.entries)


def index_split(
    pattern: str | Iterable[str],
    known: Iterable[ShardEntry] = (),
    *,
    count: bool = True,
    scanned: Callable[[ShardEntry, Members], None] | None = None,
) -> SplitIndex:
    """Each shard of the pattern (or of a wids index) with its sample count, and the index's fingerprint. A
    file of `known` (an earlier index) whose size and version are unchanged keeps its shards and counts
    without reading the file. `count=False`: tar shards not listed by a wids index are not scanned, their
    sizes read alone (a HEAD each) and their counts 0 (the planner's memory terms need no more). Each tar
    scanned gives its member table to `scanned`, as the scans finish, in order (the index then holds none:
    a large split's tables are not all in memory at once); without it the index keeps them."""
    listed: dict[str, int] = {}
    if isinstance(pattern, str) and pattern.endswith(".json"):
        store = store_for(pattern)
        listed = wids_counts(pattern, store)
        locations = list(listed)
        if not locations:
            raise ShardError(f"{pattern}: its shardlist is empty")
    else:
        locations = shard_locations(pattern)
        store = store_for(locations[0])
    previous: dict[str, list[ShardEntry]] = {}
    for entry in known:
        previous.setdefault(entry.location, []).append(entry)
    for location in locations:
        if location.startswith("s3://") != locations[0].startswith("s3://"):
            raise ShardError(f"{location}: every shard of a split lies in one kind of storage, as {locations[0]}")
    kind = split_format(locations)

    def entries_of(location: str) -> tuple[list[ShardEntry], Members | None]:
        stat = store.stat(location)
        before = previous.get(location)
        if before and all((e.size, e.version) == (stat.size, stat.version) for e in before):
            return before, None
        if kind == PARQUET:
            return row_group_entries(store, location, stat.size, stat.version), None
        if listed or not count:
            return [ShardEntry(location, listed.get(location, 0), stat.size, stat.version)], None
        members = scan_members(store, location, stat.size, stat.version)
        return [ShardEntry(location, count_samples(location, members), stat.size, stat.version)], members

    entries: list[ShardEntry] = []
    tables: dict[str, Members] = {}
    # files at once: a header scan waits a request's latency per file, S3's tens of milliseconds
    with ThreadPoolExecutor(max_workers=INDEX_THREADS, thread_name_prefix="index") as pool:
        for of_file, members in pool.map(entries_of, locations):
            entries += of_file
            if members is not None and scanned is not None:
                scanned(of_file[0], members)
            elif members is not None:
                tables[of_file[0].location] = members
    if sum(entry.samples for entry in entries) == 0 and (count or listed or kind == PARQUET):
        raise ShardError(f"{locations[0]}{' …' if len(locations) > 1 else ''}: the shards hold no samples")
    return SplitIndex(entries, fingerprint(entries), store.reads, kind, tables)


def fingerprint(entries: Iterable[ShardEntry]) -> str:
    digest = hashlib.sha256()
    for entry in entries:
        group = "" if entry.row_group is None else f"\0{entry.row_group}"
        digest.update(f"{entry.location}\0{entry.size}\0{entry.version}\0{entry.samples}{group}\n".encode())
    return FINGERPRINT_PREFIX + digest.hexdigest()


def read_shard(store: ObjectStore, entry: ShardEntry, members: Members | None = None) -> list[Sample]:
    """The shard's samples, read whole at the indexed version (a Parquet row group: its column chunks),
    checked against the index's count. A tar's files are sliced by its member table when there is one (it
    was scanned at this version), else found by parsing its headers (tarfile: about 10x the time of the
    read itself for samples of 100 kB)."""
    if entry.row_group is not None:
        return _read_row_group(store, entry)
    if members is None:
        samples = _parsed_samples(store.read(entry.location, entry.version), entry.location)
    else:
        parts = store.read_parts(entry.location, entry.version, [(at, size) for _, at, size in members])
        for (name, _, size), part in zip(members, parts, strict=True):
            if len(part) != size:
                raise ShardError(f"{entry.location}: {name}: {len(part)} of its {size} bytes in the tar (cut short)")
        samples = list(
            _samples_of(((name, part) for (name, _, _), part in zip(members, parts, strict=True)), entry.location)
        )
    if len(samples) != entry.samples:
        raise ShardError(f"{entry.location}: {len(samples)} samples, where its index counted {entry.samples}")
    return samples


def _parsed_samples(data: bytes, location: str) -> list[Sample]:
    """A tar's samples, its members found by parsing its headers."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            parsed = ((m.name, _file_bytes(data, location, m)) for m in _members(tar))
            return list(_samples_of(parsed, location))
    except tarfile.TarError as exc:
        raise ShardError(f"{location}: damaged: {exc}") from None


#: Parquet footers a process keeps, by file and version (a file's row groups are read one by one: its footer once)
_footers: OrderedDict[tuple[str, str], Any] = OrderedDict()
_footers_lock = threading.Lock()
FOOTERS_HELD = 64


def _read_row_group(store: ObjectStore, entry: ShardEntry) -> list[Sample]:
    assert entry.row_group is not None
    key = (entry.location, entry.version)
    with _footers_lock:
        footer = _footers.get(key)
    file = _parquet_file(store, entry.location, entry.size, entry.version, footer)
    with _footers_lock:
        _footers[key] = file.metadata
        _footers.move_to_end(key)
        while len(_footers) > FOOTERS_HELD:
            _footers.popitem(last=False)
    try:
        rows = file.read_row_group(entry.row_group).to_pylist()
    except ObjectError:
        raise  # the store's own, named: missing, changed, refused
    except (OSError, ValueError, IndexError) as exc:
        raise ShardError(f"{entry.name}: damaged: {exc}") from None
    if len(rows) != entry.samples:
        raise ShardError(f"{entry.name}: {len(rows)} rows, where its index counted {entry.samples}")
    return rows


def _file_bytes(data: bytes, location: str, member: tarfile.TarInfo) -> bytes:
    """A regular member's bytes, sliced from the shard's (tarfile's own reader copies them twice)."""
    content = data[member.offset_data : member.offset_data + member.size]
    if len(content) != member.size:
        raise ShardError(f"{location}: {member.name}: {len(content)} of its {member.size} bytes in the tar (cut short)")
    return content


class ShardReader:
    """A function's reads of a split's shards: each read whole, by one reading thread, at most `capacity`
    held or being read at once (the least recently used let go first). `prefetch` starts the reads of
    shards the next micro-batch needs, so that they overlap the model's compute."""

    def __init__(
        self,
        entries: list[ShardEntry],
        capacity: int,
        members: MemberTables | None = None,
        load: Callable[[ShardEntry], list[Sample]] | None = None,
    ) -> None:
        """`load`: how a shard is read, when not from where it lies (Cloudless's staged shards, from the run's
        storage: `function.data.staged_shards`)."""
        if not entries:
            raise ShardError("a split of no shards")
        self.entries, self.capacity = entries, max(1, capacity)
        self.members = members
        self.load = load
        self.store = store_for(entries[0].location) if load is None else None
        self._held: OrderedDict[int, Future[list[Sample]]] = OrderedDict()
        self._reading: ThreadPoolExecutor | None = None
        #: seconds the reading thread spent reading shards, and those a caller waited for one (the reads
        #: not hidden behind the caller's work)
        self.read_seconds = self.waited_seconds = 0.0

    def _get(self, shard: int) -> Future[list[Sample]]:
        if shard not in self._held:
            while len(self._held) >= self.capacity:
                self._held.popitem(last=False)
            if self._reading is None:
                self._reading = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shards")
            self._held[shard] = self._reading.submit(self._read, shard)
        self._held.move_to_end(shard)
        return self._held[shard]

    def _read(self, shard: int) -> list[Sample]:
        began = time.perf_counter()
        try:
            entry = self.entries[shard]
            if self.load is not None:
                return self.load(entry)
            assert self.store is not None
            table = self.members(entry) if self.members is not None and entry.row_group is None else None
            return read_shard(self.store, entry, table)
        finally:
            self.read_seconds += time.perf_counter() - began

    def sample(self, shard: int, row: int) -> Sample:
        """Row `row` of shard `shard` (a copy: a transform may change it)."""
        held = self._get(shard)
        if not held.done():
            began = time.perf_counter()
            futures.wait([held])
            self.waited_seconds += time.perf_counter() - began
        return dict(held.result()[row])

    def prefetch(self, shards: Iterable[int]) -> None:
        """Start reading these shards, in order, while the cache has room for them without letting go of one of
        them (a micro-batch that straddles two shuffle groups wants more shards than the cache holds: letting
        a wanted one go would read it twice; the rest are read when they are needed, the others let go)."""
        wanted = list(dict.fromkeys(shards))
        for shard in wanted:
            if shard in self._held:
                self._held.move_to_end(shard)
                continue
            if len(self._held) >= self.capacity:
                spare = next((held for held in self._held if held not in wanted), None)
                if spare is None:
                    return
                del self._held[spare]  # the least recently used of those not wanted
            self._get(shard)

    def prefetch_spare(self, shard: int, keep: set[int]) -> None:
        """Start reading `shard` if the cache has room for it without letting go of a shard of `keep` (the
        group being read: letting one go would read it again)."""
        if shard in self._held:
            return
        spare = [held for held in self._held if held not in keep]
        if len(self._held) < self.capacity or spare:
            if len(self._held) >= self.capacity:
                del self._held[spare[0]]  # the least recently used of those not needed
            self._get(shard)

    @property
    def held(self) -> int:
        return len(self._held)

    def close(self) -> None:
        if self._reading is not None:
            self._reading.shutdown(wait=False, cancel_futures=True)
            self._reading = None


__all__ = [
    "IN_PLACE_FORMATS",
    "ObjectError",
    "ShardEntry",
    "ShardError",
    "ShardReader",
    "SplitIndex",
    "index_split",
    "read_shard",
    "shard_locations",
]

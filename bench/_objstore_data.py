"""bench/object_store.py's data: the same JPEGs on disk, as one object per image, WebDataset
tar shards, a Parquet export, Mosaic's MDS shards and LitData's chunks, all in the bench's
bucket."""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from _common import cores
from _objstore_peers import upload_tree, write_litdata, write_mds
from _objstore_s3 import Store
from loader_vs_dataloader import write_images

BUCKET = "batchd-bench"


@dataclass
class Data:
    """Where each form of the image set is, and how it was cut."""

    files: list[tuple[str, int]]
    image_bytes: int
    parquet_files: int = 0
    tar_shards: int = 0
    mds_shards: int = 0
    litdata_chunks: int = 0
    notes: list[str] = field(default_factory=list)


def prepare_data(args: argparse.Namespace, root: Path, store: Store) -> Data:
    """Images on disk, then the same bytes as objects, Parquet, MDS and LitData chunks."""
    files = write_images(root / "images", args.images)
    data = Data(files, sum(Path(p).stat().st_size for p, _ in files))
    client = store.client()

    def put(item: tuple[str, int]) -> None:
        path = Path(item[0])
        key = f"images/{path.relative_to(root / 'images').as_posix()}"
        client.upload_file(str(path), BUCKET, key)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, files))
    data.parquet_files = write_parquet(files, root / "parquet", args.parquet_rows)
    upload_tree(client, root / "parquet", BUCKET, "parquet")
    shard_bytes = args.shard_mib << 20
    data.tar_shards = write_tars(files, root / "tars", shard_bytes)
    upload_tree(client, root / "tars", BUCKET, "tars")
    data.mds_shards = write_mds(files, root / "mds", shard_bytes)
    upload_tree(client, root / "mds", BUCKET, "mds")
    data.litdata_chunks = write_litdata(files, root / "litdata", shard_bytes, cores())
    upload_tree(client, root / "litdata", BUCKET, "litdata")
    return data


def write_tars(files: list[tuple[str, int]], out: Path, shard_bytes: int) -> int:
    """The images as WebDataset tar shards of at most ``shard_bytes`` (the peers' shard
    size): sample ``i`` is ``{i:06d}.jpg`` (the JPEG's bytes) and ``{i:06d}.cls`` (its
    label), in the images' order. Returns the number of shards."""
    import io
    import tarfile

    out.mkdir(parents=True)
    shards: list[list[tuple[int, bytes, int]]] = [[]]
    size = 0
    for i, (path, label) in enumerate(files):
        data = Path(path).read_bytes()
        if shards[-1] and size + len(data) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((i, data, label))
        size += len(data) + 1536  # two headers and padding
    for count, members in enumerate(shards):
        with tarfile.open(out / f"shard-{count:05d}.tar", "w", format=tarfile.USTAR_FORMAT) as t:
            for i, data, label in members:
                for name, payload in ((f"{i:06d}.jpg", data), (f"{i:06d}.cls", b"%d" % label)):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    t.addfile(info, io.BytesIO(payload))
    return len(shards)


def write_parquet(files: list[tuple[str, int]], out: Path, rows_per_file: int) -> int:
    """The images as Parquet: ``key`` (the file's relative path), ``image`` (binary, the
    JPEG's bytes), ``label`` (int64); ``rows_per_file`` rows a file, one row group per 64
    rows, no compression (JPEG bytes do not compress). Returns the number of files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True)
    count = 0
    for start in range(0, len(files), rows_per_file):
        part = files[start : start + rows_per_file]
        table = pa.table(
            {
                "key": [Path(p).parent.name + "/" + Path(p).name for p, _ in part],
                "image": pa.array([Path(p).read_bytes() for p, _ in part], pa.binary()),
                "label": pa.array([label for _, label in part], pa.int64()),
            }
        )
        pq.write_table(
            table, out / f"part-{count:05d}.parquet", row_group_size=64, compression="none"
        )
        count += 1
    return count

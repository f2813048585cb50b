"""The peers of ``bench/object_store.py``: Mosaic Streaming and LitData on the same images.

Both get the same files (the bench's photo-like JPEGs), stored as raw JPEG bytes in their own
format (Mosaic: MDS shards; LitData: ``litdata.optimize`` chunks), uploaded to the same S3
bucket as batchd's objects, and read through the same delaying proxy. Each decodes a sample
with the very function batchd's workers run (``ImagePipeline(size=224,
decoder=...).decode_into``), in a ``torch.utils.data.DataLoader`` (LitData: its
``StreamingDataLoader``) with one worker per core, as their docs set them up for one node.

Mosaic Streaming 0.13.0 imports ``torchvision`` at ``import streaming`` (only for
``streaming.vision``, which the bench does not use), and torchvision cannot be installed beside
the CPU torch here. :func:`torchvision_shim` puts a stand-in on ``sys.path`` when, and only
when, the real one is missing: a ``VisionDataset`` class and a ``to_tensor`` that raises. The
bench prints whether it was used.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from batchd_server.pipelines.base import SampleInfo
from batchd_server.pipelines.image import ImagePipeline

__all__ = [
    "Decode",
    "litdata_loader",
    "litdata_raw_loader",
    "mosaic_loader",
    "torchvision_shim",
    "upload_tree",
    "write_litdata",
    "write_mds",
]

_SHIM = {
    "torchvision/__init__.py": '"""A stand-in of bench/object_store.py (_objstore_peers.py)."""\n',
    "torchvision/datasets.py": (
        "from torch.utils.data import Dataset\n\n\n"
        "class VisionDataset(Dataset):  # what streaming.vision subclasses; unused here\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        raise NotImplementedError('torchvision stand-in: not installed')\n"
    ),
    "torchvision/transforms/__init__.py": "",
    "torchvision/transforms/functional.py": (
        "def to_tensor(*args, **kwargs):\n"
        "    raise NotImplementedError('torchvision stand-in: not installed')\n"
    ),
}


def torchvision_shim() -> str:
    """Make ``import streaming`` work without torchvision; say what was done.

    Returns a line for the settings: the real torchvision, or the stand-in's path.
    """
    if importlib.util.find_spec("torchvision") is not None:
        return "torchvision: installed (no stand-in)"
    root = Path(tempfile.mkdtemp(prefix="batchd-bench-tvshim-"))
    for name, text in _SHIM.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    sys.path.insert(0, str(root))
    return (
        "torchvision: not installed; a stand-in (VisionDataset, to_tensor that raise) on "
        "sys.path only so that `import streaming` works: Mosaic's streaming.vision is unused"
    )


class Decode:
    """Raw JPEG bytes + label -> the sample dict batchd's Loader yields, by batchd's decode."""

    def __init__(self, size: int, decoder: str) -> None:
        self.size = size
        self.pipeline = ImagePipeline(size=size, decoder=decoder)

    def __call__(self, data: bytes, label: int, index: int) -> dict[str, Any]:
        image = np.empty((3, self.size, self.size), np.uint8)
        info = SampleInfo(sample_id=index, label=label, path="", length=-1, seed=0, epoch=0)
        self.pipeline.decode_into(memoryview(data), info, {"image": image})
        return {"image": torch.from_numpy(image), "label": label, "sample_id": index}


# ------------------------------------------------------------------------------ writing


def write_mds(files: Sequence[tuple[str, int]], out: Path, shard_bytes: int) -> int:
    """Mosaic's MDS shards of ``files`` (JPEG bytes as ``bytes``, label ``int``) in ``out``;
    returns the number of shards."""
    from streaming import MDSWriter

    columns = {"image": "bytes", "label": "int"}
    with MDSWriter(out=str(out), columns=columns, size_limit=shard_bytes) as writer:
        for path, label in files:
            writer.write({"image": Path(path).read_bytes(), "label": label})
    return sum(1 for _ in out.glob("*.mds"))


def _litdata_item(item: tuple[str, int]) -> dict[str, Any]:
    path, label = item
    return {"image": Path(path).read_bytes(), "label": label}


def write_litdata(
    files: Sequence[tuple[str, int]], out: Path, chunk_bytes: int, workers: int
) -> int:
    """``litdata.optimize`` of ``files`` into ``out`` (JPEG bytes kept as bytes, no
    torchvision serializer); returns the number of chunks."""
    import litdata

    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        litdata.optimize(
            fn=_litdata_item,
            inputs=list(files),
            output_dir=str(out),
            chunk_bytes=chunk_bytes,
            num_workers=workers,
            start_method="fork",
            verbose=False,
        )
    return sum(1 for _ in out.glob("*.bin"))


def upload_tree(client: Any, local: Path, bucket: str, prefix: str) -> int:
    """Every file under ``local`` to ``s3://bucket/prefix/...``; returns the bytes sent."""
    sent = 0
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(local).as_posix()}"
        client.upload_file(str(path), bucket, key)
        sent += path.stat().st_size
    return sent


# ------------------------------------------------------------------------------ loaders


def mosaic_loader(
    remote: str, local: Path, *, batch_size: int, workers: int, decode: Decode
) -> DataLoader[Any]:
    """A Mosaic ``StreamingDataset`` (shuffled, its local cache in ``local``) in a DataLoader.

    Reads ``s3://`` through boto3 at ``S3_ENDPOINT_URL``, as Mosaic does. Persistent workers
    keep the dataset's cache and state between epochs (the warm runs).
    """
    from streaming import StreamingDataset

    class MosaicImages(StreamingDataset):
        def __getitem__(self, index: Any) -> dict[str, Any]:
            sample = super().__getitem__(index)
            return decode(sample["image"], int(sample["label"]), index)

    dataset = MosaicImages(
        remote=remote, local=str(local), shuffle=True, shuffle_seed=0, batch_size=batch_size
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        **_pool(workers),
    )


def _pool(workers: int) -> dict[str, Any]:
    """Every peer's DataLoader pool: ``workers`` forked processes kept across epochs (the
    warm runs), 4 batches prefetched each."""
    return {
        "num_workers": workers,
        "persistent_workers": workers > 0,
        "prefetch_factor": 4 if workers else None,
        "multiprocessing_context": "fork" if workers else None,
    }


def allow_plain_http_for_litdata() -> str:
    """Let LitData's obstore path talk to an ``http://`` endpoint; say what was changed.

    LitData 0.2.76 builds its obstore ``S3Store`` (the chunk downloads) with fixed client
    options that lack ``allow_http``, so against a plain-HTTP store every chunk GET fails
    ("HTTP error: builder error") and ``AWS_ALLOW_HTTP`` is not read. The bench adds the one
    option to that dict; everything else of LitData's path stays as shipped (a real S3
    endpoint is HTTPS and would not need it).
    """
    from litdata.streaming import downloader

    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        options["allow_http"] = "true"
        return "LitData: allow_http added to its obstore client options (plain-HTTP store)"
    return "LitData: obstore client options not found; its downloads use what it ships"


class _LitTransform:
    """LitData's ``transform`` hook: its sample dict -> the decoded sample."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.count = 0

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        self.count += 1
        return self.decode(bytes(sample["image"]), int(sample["label"]), self.count)


def litdata_loader(
    remote: str,
    cache: Path,
    *,
    batch_size: int,
    workers: int,
    decode: Decode,
    storage_options: dict[str, Any],
) -> Any:
    """A LitData ``StreamingDataset`` (shuffled, its cache in ``cache``) in its
    ``StreamingDataLoader``; ``storage_options`` go to its boto3 client (endpoint, keys)."""
    from litdata import StreamingDataLoader, StreamingDataset

    allow_plain_http_for_litdata()
    transform: Callable[[dict[str, Any]], dict[str, Any]] = _LitTransform(decode)
    dataset = StreamingDataset(
        remote,
        cache_dir=str(cache),
        shuffle=True,
        seed=0,
        storage_options=storage_options,
        transform=transform,
    )
    return StreamingDataLoader(
        dataset,
        batch_size=batch_size,
        **_pool(workers),
    )


def litdata_raw_loader(
    remote: str,
    cache: Path,
    *,
    batch_size: int,
    workers: int,
    decode: Decode,
    storage_options: dict[str, Any],
    label_of: Callable[[str], int],
) -> DataLoader[Any]:
    """LitData's ``StreamingRawDataset`` over one object per image (no ``optimize`` step),
    in the plain ``DataLoader`` its docs pair it with, shuffled; ``cache_files=True`` keeps
    every object it fetched in ``cache`` (the warm epochs read them there).

    Its file index is built when the dataset is made, before the timing, from one listing
    through the bench's boto3 client (LitData's own indexer lists through s3fs, which is not
    installed here, and would upload its index into the bucket). ``label_of`` maps an
    object's ``s3://`` URL to its label; the transform is the bench's decode.
    """
    from litdata.raw.dataset import StreamingRawDataset
    from litdata.raw.indexer import BaseIndexer, FileMetadata

    allow_plain_http_for_litdata()

    class Listing(BaseIndexer):
        def discover_files(
            self, input_dir: str, options: dict[str, Any] | None
        ) -> list[FileMetadata]:
            import boto3

            bucket, _, prefix = input_dir.removeprefix("s3://").partition("/")
            client = boto3.client("s3", **(options or {}))
            found = []
            for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix
            ):
                for item in page.get("Contents", []):
                    found.append(FileMetadata(f"s3://{bucket}/{item['Key']}", item["Size"]))
            return found

        def build_or_load_index(
            self,
            input_dir: str,
            cache_dir: str,
            options: dict[str, Any] | None,
            recompute_index: bool = False,
        ) -> list[FileMetadata]:
            return self.discover_files(input_dir, options)

    class Pixels:
        def __call__(self, data: bytes) -> Any:
            return decode(data, -1, -1)["image"]

    class RawImages(StreamingRawDataset):
        def __getitems__(self, indices: list[int]) -> list[Any]:
            images = super().__getitems__(indices)
            return [
                {"image": image, "label": label_of(self.items[i].path), "sample_id": i}
                for image, i in zip(images, indices, strict=True)
            ]

    dataset = RawImages(
        remote,
        cache_dir=str(cache),
        indexer=Listing(),
        storage_options=storage_options,
        cache_files=True,
        transform=Pixels(),
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        **_pool(workers),
    )

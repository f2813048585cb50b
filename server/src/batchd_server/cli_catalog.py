"""The catalog commands of ``batchd-server``: ingest (manifest, image folder, tar shards),
demo-data and datasets. ``cli.py`` parses the command line and calls these."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only catalog/ imports SQLAlchemy
    from batchd_server.catalog.db import Engine

__all__ = [
    "cmd_datasets",
    "cmd_demo_data",
    "cmd_ingest_imagefolder",
    "cmd_ingest_manifest",
    "cmd_ingest_tar",
]

PROG = "batchd-server"
log = logging.getLogger(PROG)


def cmd_ingest_manifest(args: argparse.Namespace, engine: Engine) -> int:
    from batchd_server.catalog.ingest import ingest_manifest

    report = ingest_manifest(
        engine,
        dataset=args.dataset,
        version=args.dataset_version,
        root=args.root,
        manifest=args.manifest,
        split=args.split,
        verify=args.verify,
        description=args.description,
    )
    print(report.summary())
    return 0


def cmd_ingest_imagefolder(args: argparse.Namespace, engine: Engine) -> int:
    from batchd_server.catalog.ingest import ingest_imagefolder

    report = ingest_imagefolder(
        engine,
        dataset=args.dataset,
        version=args.dataset_version,
        root=args.root,
        split=args.split,
        description=args.description,
    )
    print(report.summary())
    return 0


def cmd_ingest_tar(args: argparse.Namespace, engine: Engine) -> int:
    from batchd_server.catalog.ingest import ingest_tar

    def progress(done: int, total: int, samples: int) -> None:
        # A bar on a terminal only: logs and pipes get the summary alone.
        width = 30
        bar = "#" * (width * done // total)
        end = "\n" if done == total else ""
        print(
            f"\r[{bar:<{width}}] {done}/{total} shards, {samples} samples",
            end=end,
            file=sys.stderr,
            flush=True,
        )

    report = ingest_tar(
        engine,
        dataset=args.dataset,
        version=args.dataset_version,
        root=args.root,
        shards=args.shards,
        split=args.split,
        label_key=args.label_key,
        description=args.description,
        progress=progress if sys.stderr.isatty() else None,
    )
    print(report.summary())
    return 0


def cmd_demo_data(args: argparse.Namespace, engine: Engine) -> int:
    from batchd_server.catalog.ingest import ingest_imagefolder
    from batchd_server.demo_data import write_demo_images

    out = Path(args.out).expanduser()
    written = write_demo_images(out, args.images, seed=args.seed, classes=args.classes)
    log.info(
        "wrote %d of %d images (%d bytes) under %s",
        written["written"],
        written["images"],
        written["bytes"],
        out,
    )
    report = ingest_imagefolder(
        engine,
        dataset=args.dataset,
        version=args.dataset_version,
        root=out,
        description=f"synthetic demo images (seed {args.seed}, {args.classes} classes)",
    )
    print(report.summary())
    return 0


def cmd_datasets(args: argparse.Namespace, engine: Engine) -> int:
    from batchd_server.catalog.db import describe_url
    from batchd_server.catalog.queries import list_datasets

    found = list_datasets(engine)
    if not found:
        print(
            f"no datasets in the catalog at {describe_url(str(engine.url))}; add one with "
            f"`{PROG} ingest imagefolder`, `{PROG} ingest manifest` or `{PROG} demo-data`"
        )
        return 0
    header = ("NAME", "VERSION", "ROOT", "SPLITS (verified/total)", "CREATED")
    rows = [
        (
            d.name,
            d.version,
            d.root,
            ", ".join(f"{s.name} {s.verified}/{s.samples}" for s in d.splits) or "(no samples)",
            d.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
        for d in found
    ]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return 0

"""The catalog commands of ``batchd-server``: migrate, ingest (manifest, image folder, tar
shards, Parquet), demo-data and datasets; their arguments and what they do. ``cli.py`` parses the
command line and calls these."""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only catalog/ imports SQLAlchemy
    from batchd_server.catalog.db import Engine

__all__ = [
    "add_commands",
    "cmd_datasets",
    "cmd_demo_data",
    "cmd_ingest",
    "cmd_migrate",
]

PROG = "batchd-server"
log = logging.getLogger(PROG)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _dataset_args(p: argparse.ArgumentParser, *, dataset_default: str | None = None) -> None:
    if dataset_default is None:
        p.add_argument("--dataset", required=True, help="dataset name")
    else:
        p.add_argument("--dataset", default=dataset_default, help="dataset name (%(default)s)")
    p.add_argument(
        "--version",
        dest="dataset_version",
        default="1",
        metavar="V",
        help="dataset version (default %(default)s); rows of a version never change, so "
        "changed data goes into a new version",
    )


def _ingest_kinds(
    sub: Any, common: argparse.ArgumentParser
) -> Callable[..., argparse.ArgumentParser]:
    """Add ``ingest`` to ``sub``; returns what adds one ``ingest KIND`` (its name, help, what
    its ``--root`` is and, unless None, its ``--split``) with what every kind takes: the
    dataset, its root, a split and a description. :func:`cmd_ingest` runs them all."""
    ingest = sub.add_parser("ingest", help="add samples to the catalog")
    kinds = ingest.add_subparsers(dest="kind", required=True, metavar="KIND")

    def add(
        kind: str, help: str, root_help: str, split_help: str | None
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = kinds.add_parser(kind, parents=[common], help=help)
        _dataset_args(p)
        p.add_argument("--root", required=True, help=root_help)
        if split_help is not None:
            p.add_argument("--split", help=split_help)
        p.add_argument("--description")
        p.set_defaults(func=cmd_ingest)
        return p

    return add


def _patterns(p: argparse.ArgumentParser, dest: str, metavar: str, what: str, example: str) -> None:
    """The files an ingest reads, as paths, globs or brace ranges under ``--root``."""
    help = f"{what}, globs or brace ranges ({example}), relative to --root"
    p.add_argument(dest, metavar=metavar, nargs="+", help=help)


def _text_args(p: argparse.ArgumentParser) -> None:
    """What counts the tokens of text documents (for batchd.Pack)."""
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a tokenizer.json: record each document's token count, which batchd.Pack plans "
        "from (the Loader's batchd.Text/Chat must use the same file)",
    )
    p.add_argument(
        "--template", metavar="FILE", help="a Jinja chat template (default: the tokenizer's)"
    )
    p.add_argument(
        "--workers",
        type=_positive_int,
        metavar="N",
        help="processes counting tokens (default: the CPUs this process may use)",
    )


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add migrate, ingest, demo-data and datasets to the subcommands ``sub`` (argparse's
    ``add_subparsers`` object), each with the options of ``common``."""
    p = sub.add_parser(
        "migrate", parents=[common], help="upgrade the catalog schema to the newest revision"
    )
    p.add_argument("--downgrade", metavar="REVISION", help="downgrade instead (base: remove all)")
    p.set_defaults(func=cmd_migrate)

    kind = _ingest_kinds(sub, common)
    kind(
        "imagefolder",
        "images under ROOT/<split>/<class>/ (or ROOT/<class>/ with --split)",
        "the image tree's top directory, or s3://, gs:// or az://BUCKET/PREFIX",
        "the whole tree is this split: ROOT/<class>/<image>",
    )

    for media, what in (("video", "videos"), ("audio", "audio files")):
        p = kind(
            f"{media}folder",
            f"{what} under ROOT/<split>/<class>/ (or ROOT/<class>/ with --split), each probed "
            "for its duration",
            f"the {media} tree's top directory, or s3://BUCKET/PREFIX",
            "the whole tree is this split: ROOT/<class>/<file>",
        )
        p.add_argument(
            "--workers",
            type=_positive_int,
            metavar="N",
            help="processes probing files (default: the CPUs this process may use)",
        )
        p.set_defaults(progress_of="files")

    p = kind(
        "manifest",
        "rows of a JSONL (.jsonl/.ndjson) or CSV manifest",
        "directory (or s3://, gs:// or az://BUCKET/PREFIX) the manifest's paths are under",
        "split of rows that have none",
    )
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="trust the manifest: do not stat files or list the object store (every row is "
        "verified, byte_size is byte_length)",
    )
    p.add_argument("manifest", metavar="FILE")

    p = kind(
        "tar",
        "WebDataset tar shards: samples as byte ranges inside them (nothing extracted)",
        "directory (or s3://, gs:// or az://BUCKET/PREFIX) the shards are under",
        "split of every sample (default: train/val/test in the name)",
    )
    p.add_argument(
        "--label-key", default="label", help="field of a .json member with the label (label)"
    )
    _patterns(p, "shards", "SHARD", "shard files", "shard-{000..099}.tar")
    p.set_defaults(progress_of="shards")

    p = kind(
        "parquet",
        "Parquet files: one row, one sample (its payload column decoded by the pipeline)",
        "directory (or s3://, gs:// or az://BUCKET/PREFIX) the files are under",
        None,
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--split", help="split of every row")
    where.add_argument("--split-column", metavar="COLUMN", help="string column of each row's split")
    sample = p.add_mutually_exclusive_group(required=True)
    sample.add_argument(
        "--payload",
        metavar="COLUMN",
        help="the sample: binary (image bytes, .npy, raw), a list of integers (tokens) or a "
        "fixed-size list of numbers (arrays); a struct's field as image.bytes",
    )
    sample.add_argument(
        "--text", metavar="COLUMN", help="a string column of text documents (batchd.Text)"
    )
    _text_args(p)
    p.add_argument("--label", metavar="COLUMN", help="integer column of labels")
    p.add_argument("--key", metavar="COLUMN", help="column of unique keys (default FILE#ROW)")
    p.add_argument(
        "--length",
        metavar="COLUMN",
        help="integer column of sequence lengths (default: a list payload's length)",
    )
    _patterns(p, "files", "FILE", "Parquet files", "part-{0000..0099}.parquet")
    p.set_defaults(progress_of="files")

    p = kind(
        "jsonl",
        "text or chat documents in JSONL files: one line, one document, read where it lies",
        "directory (or s3://, gs:// or az://BUCKET/PREFIX) the files are under",
        None,
    )
    p.add_argument("--split", required=True, help="split of every document")
    field = p.add_mutually_exclusive_group(required=True)
    field.add_argument("--text", metavar="FIELD", help="field of each line's text (a string)")
    field.add_argument(
        "--messages", metavar="FIELD", help="field of each line's chat: [{role, content}, ...]"
    )
    _text_args(p)
    _patterns(p, "files", "FILE", "JSONL files", "part-{0000..0099}.jsonl")
    p.set_defaults(progress_of="files")

    p = sub.add_parser("demo-data", parents=[common], help="write synthetic JPEGs and ingest them")
    _dataset_args(p, dataset_default="demo")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write the images")
    p.add_argument("--images", required=True, type=_positive_int, metavar="N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--classes", type=_positive_int, default=4)
    p.set_defaults(func=cmd_demo_data)

    p = sub.add_parser("datasets", parents=[common], help="list datasets and their splits")
    p.set_defaults(func=cmd_datasets)


def cmd_migrate(args: argparse.Namespace, engine: Engine) -> int:
    from batchd_server.catalog import migrate
    from batchd_server.catalog.db import describe_url

    if args.downgrade:
        migrate.downgrade(engine, args.downgrade)
    else:
        migrate.upgrade(engine)
    revision = migrate.current_revision(engine)
    where = describe_url(str(engine.url))
    if revision is None:
        print(f"{where}: at base (no batchd schema)")
    else:
        head = " (head)" if revision == migrate.head_revision() else ""
        print(f"{where}: at revision {revision}{head}")
    return 0


def cmd_ingest(args: argparse.Namespace, engine: Engine) -> int:
    """``ingest KIND``: call the kind's ingest function (``catalog/ingest/<kind>.py``) with
    each parsed argument that names one of its parameters (a flag's dest is the parameter's
    name), so a new kind needs its arguments here and nothing else."""
    from batchd_server.catalog import ingest

    function = getattr(ingest, f"ingest_{args.kind}")
    parameters = inspect.signature(function).parameters
    values = {name: value for name, value in vars(args).items() if name in parameters}
    values["version"] = args.dataset_version
    values["object_store_retry_s"] = args.config.object_store_retry_s
    if "progress" in parameters and sys.stderr.isatty():
        values["progress"] = _progress(args.progress_of)
    print(function(engine, **values).summary())
    return 0


def _progress(what: str) -> Callable[[int, int, int], None]:
    def progress(done: int, total: int, samples: int) -> None:
        # A bar on a terminal only: logs and pipes get the summary alone.
        width = 30
        bar = "#" * (width * done // total)
        end = "\n" if done == total else ""
        print(
            f"\r[{bar:<{width}}] {done}/{total} {what}, {samples} samples",
            end=end,
            file=sys.stderr,
            flush=True,
        )

    return progress


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

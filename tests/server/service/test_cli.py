"""The ``batchd-server`` command, run as a real subprocess against Postgres and SQLite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa

from batchd_server.catalog.db import make_engine

TABLES = {"datasets", "samples", "sample_errors"}


def batchd_server(
    *args: str, url: str, home: Path, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BATCHD_DATABASE_URL": url, "BATCHD_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "batchd_server.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def table_names(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_migrate_creates_the_schema_on_empty_postgres_and_downgrade_base_removes_it(
    pg_url: str, tmp_path: Path
) -> None:
    """`migrate` reaches head and says so; `migrate --downgrade base` removes every table."""
    up = batchd_server("migrate", url=pg_url, home=tmp_path)
    assert up.returncode == 0, up.stderr
    assert "at revision" in up.stdout and "(head)" in up.stdout
    assert table_names(pg_url) >= TABLES

    down = batchd_server("migrate", "--downgrade", "base", url=pg_url, home=tmp_path)
    assert down.returncode == 0, down.stderr
    assert "at base" in down.stdout
    assert TABLES.isdisjoint(table_names(pg_url))


def test_an_unmigrated_postgres_gets_a_one_line_hint_to_migrate(
    pg_url: str, tmp_path: Path
) -> None:
    """Ingest before `migrate` exits 2 with one line that names the command to run."""
    result = batchd_server("datasets", url=pg_url, home=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("batchd-server: error: ")
    assert result.stderr.count("\n") == 1 and "batchd-server migrate" in result.stderr


def test_demo_data_then_datasets_lists_the_dataset_with_split_counts(
    catalog_url: str, tmp_path: Path
) -> None:
    """demo-data writes and ingests the images; `datasets` shows root and split counts."""
    assert batchd_server("migrate", url=catalog_url, home=tmp_path).returncode == 0
    empty = batchd_server("datasets", url=catalog_url, home=tmp_path)
    assert empty.returncode == 0 and "no datasets" in empty.stdout

    out = tmp_path / "demo"
    args = ("demo-data", "--out", str(out), "--images", "20", "--seed", "1")
    made = batchd_server(*args, url=catalog_url, home=tmp_path)
    assert made.returncode == 0, made.stderr
    assert "20 rows read, 20 inserted" in made.stdout
    assert len(list(out.rglob("*.jpg"))) == 20
    again = batchd_server(*args, url=catalog_url, home=tmp_path)
    assert "0 inserted, 20 already present" in again.stdout

    listed = batchd_server("datasets", url=catalog_url, home=tmp_path)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "VERSION", "ROOT"]
    assert row.split()[:3] == ["demo", "1", str(out.resolve())]
    assert "train 16/16, val 4/4" in row


def test_a_bad_manifest_exits_2_with_one_line_naming_the_line(
    catalog_url: str, tmp_path: Path
) -> None:
    """No traceback: one `batchd-server: error:` line with the file, line and field."""
    root = tmp_path / "data"
    root.mkdir()
    manifest = tmp_path / "m.jsonl"
    rows = [{"path": "a.jpg", "split": "train"}, {"path": "../b.jpg", "split": "train"}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    batchd_server("migrate", url=catalog_url, home=tmp_path)
    result = batchd_server(
        "ingest", "manifest", "--dataset", "d", "--root", str(root), str(manifest),
        url=catalog_url, home=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("batchd-server: error: ")
    assert result.stderr.count("\n") == 1
    assert f"{manifest}, line 2: path='../b.jpg'" in result.stderr


def test_manifest_ingest_with_no_verify_and_a_default_split(
    catalog_url: str, tmp_path: Path
) -> None:
    """`ingest manifest --no-verify --split S` trusts the rows and prints the summary."""
    manifest = tmp_path / "m.csv"
    manifest.write_text("path,label\nx/1.jpg,0\nx/2.jpg,1\n")
    batchd_server("migrate", url=catalog_url, home=tmp_path)
    result = batchd_server(
        "ingest", "manifest", "--dataset", "d", "--version", "7", "--root", str(tmp_path / "r"),
        "--split", "train", "--no-verify", str(manifest),
        url=catalog_url, home=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "dataset 'd' version '7': 2 rows read, 2 inserted" in result.stdout
    listed = batchd_server("datasets", url=catalog_url, home=tmp_path)
    assert "train 2/2" in listed.stdout


def test_usage_errors_exit_2_and_version_prints_the_version(tmp_path: Path) -> None:
    """argparse errors exit 2; --version prints the program and version and exits 0."""
    url = f"sqlite:///{tmp_path / 'c.db'}"
    missing = batchd_server("ingest", "manifest", "--dataset", "d", url=url, home=tmp_path)
    assert missing.returncode == 2 and "--root" in missing.stderr
    version = batchd_server("--version", url=url, home=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("batchd-server ")


def test_every_flag_of_each_ingest_kind_names_a_parameter_of_its_ingest_function() -> None:
    """``ingest KIND`` passes each parsed argument on by name, so a flag whose dest names no
    parameter of ``catalog.ingest.ingest_<kind>`` would be dropped without a word."""
    import argparse
    import inspect

    from batchd_server import cli_catalog
    from batchd_server.catalog import ingest
    from batchd_server.cli import build_parser
    from batchd_server.config import ServerConfig
    from batchd_server.settings import declared

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    kinds_action = next(
        a for a in commands.choices["ingest"]._actions if isinstance(a, argparse._SubParsersAction)
    )
    settings = {f.name for f, _ in declared(ServerConfig)} | {"log_level", "help"}
    passed_on = {"dataset_version", "progress_of"}  # cmd_ingest maps these itself
    kinds = {"imagefolder", "manifest", "tar", "parquet", "jsonl", "videofolder", "audiofolder"}
    assert set(kinds_action.choices) == kinds
    for kind, sub in kinds_action.choices.items():
        function = getattr(ingest, f"ingest_{kind}")
        parameters = set(inspect.signature(function).parameters)
        assert sub.get_default("func") is cli_catalog.cmd_ingest, kind
        dests = {a.dest for a in sub._actions} - settings - passed_on
        assert dests, kind
        assert dests <= parameters, (kind, dests - parameters)
        assert {"version", "object_store_retry_s"} <= parameters, kind

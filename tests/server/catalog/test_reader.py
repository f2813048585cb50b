"""load_split reads exactly the verified rows of one split into compact arrays."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from batchd_server.catalog.columns import ColumnBuilder
from batchd_server.catalog.copy_parser import PackedCopyParser
from batchd_server.catalog.reader import load_split, split_query
from batchd_server.catalog.schema import datasets, samples
from batchd_server.catalog.types import DatasetRef, Snapshot, SplitArrays
from batchd_server.errors import InvalidArgument, NotFound, SnapshotMismatch

AWKWARD_PATHS = [
    "plain/0001.jpg",
    "猫/ünïcode 🐈.png",
    "tab\there.jpg",
    "back\\slash\\N.jpg",
    "new\nline\r\n.jpg",
    "controls \b\f\v end",
    "\\",
    "",
]


def add_dataset(conn: sa.Connection, name: str = "pets", version: str = "v1") -> int:
    values = {"name": name, "version": version, "root": f"/data/{name}/{version}"}
    return conn.execute(sa.insert(datasets).values(values).returning(datasets.c.id)).scalar_one()


def add_samples(conn: sa.Connection, dataset_id: int, rows: Sequence[dict[str, Any]]) -> list[int]:
    """Insert rows one by one (so ids follow list order) and return their ids."""
    ids = []
    for i, row in enumerate(rows):
        values = {"dataset_id": dataset_id, "key": f"k{i}", "path": f"p{i}.jpg", "split": "train"}
        insert = sa.insert(samples).values({**values, **row}).returning(samples.c.id)
        ids.append(conn.execute(insert).scalar_one())
    return ids


def bulk_samples(conn: sa.Connection, dataset_id: int, split: str, n: int, prefix: str) -> None:
    conn.execute(
        sa.insert(samples),
        [
            {
                "dataset_id": dataset_id,
                "key": f"{prefix}{i}",
                "path": f"{prefix}/{i:06d}.jpg",
                "split": split,
                "label": i % 10,
            }
            for i in range(n)
        ],
    )


def as_rows(arrays: SplitArrays) -> list[tuple[Any, ...]]:
    return [
        (
            int(arrays.ids[i]),
            int(arrays.labels[i]),
            int(arrays.lengths[i]),
            float(arrays.weights[i]),
            int(arrays.byte_offsets[i]),
            int(arrays.byte_lengths[i]),
            arrays.path(i),
        )
        for i in range(len(arrays))
    ]


def test_loaded_arrays_equal_the_inserted_rows_in_id_order(engine: Engine) -> None:
    """Every column round-trips: nulls as -1, float32 weights, byte ranges, awkward paths."""
    rows: list[dict[str, Any]] = [
        {
            "path": path,
            "label": None if i % 3 == 0 else i * 1_000_000_007,
            "length": None if i % 2 else i * 7,
            "weight": [1.0, 0.5, 2.25, 1e-3, 0.0, 3e38][i % 6],
            "byte_offset": None if i % 4 == 0 else (i << 33),
            "byte_length": None if i % 4 == 0 else 512 + i,
        }
        for i, path in enumerate(AWKWARD_PATHS * 2)
    ]
    with engine.begin() as conn:
        ids = add_samples(conn, add_dataset(conn), rows)

    arrays = load_split(engine, "pets", "train")

    expected = [
        (
            id_,
            -1 if r["label"] is None else r["label"],
            -1 if r["length"] is None else r["length"],
            float(np.float32(r["weight"])),
            -1 if r["byte_offset"] is None else r["byte_offset"],
            -1 if r["byte_length"] is None else r["byte_length"],
            r["path"],
        )
        for id_, r in zip(ids, rows, strict=True)
    ]
    assert as_rows(arrays) == expected
    assert (np.diff(arrays.ids) > 0).all()
    assert arrays.ids.dtype == np.int64 and arrays.labels.dtype == np.int64
    assert arrays.lengths.dtype == np.int32 and arrays.weights.dtype == np.float32
    assert arrays.path_bytes.tobytes() == "".join(r["path"] for r in rows).encode()
    assert arrays.snapshot == Snapshot(max_sample_id=max(ids), row_count=len(rows))
    assert (arrays.dataset.name, arrays.dataset.version, arrays.split) == ("pets", "v1", "train")
    assert not arrays.ids.flags.writeable


def test_only_verified_rows_of_the_requested_split_and_dataset_are_loaded(engine: Engine) -> None:
    """Other datasets, other versions, other splits and unverified rows stay out."""
    with engine.begin() as conn:
        pets = add_dataset(conn, "pets")
        other = add_dataset(conn, "cars")
        pets_v0 = add_dataset(conn, "pets", "v0")
        add_samples(conn, other, [{"path": "cars.jpg"}] * 3)
        add_samples(conn, pets_v0, [{"path": "old.jpg"}] * 3)
        ids = add_samples(
            conn,
            pets,
            [
                {"path": "a.jpg"},
                {"path": "val.jpg", "split": "val"},
                {"path": "bad.jpg", "is_verified": False},
                {"path": "b.jpg"},
            ],
        )

    arrays = load_split(engine, "pets", "train", version="v1")

    assert arrays.ids.tolist() == [ids[0], ids[3]]
    assert [arrays.path(i) for i in range(len(arrays))] == ["a.jpg", "b.jpg"]
    assert load_split(engine, "pets", "val", version="v1").ids.tolist() == [ids[1]]
    assert [load_split(engine, "pets", "train", version="v0").path(0)] == ["old.jpg"]


def test_snapshot_read_after_new_rows_returns_exactly_the_earlier_rows(engine: Engine) -> None:
    """New rows, in this split and others, are invisible to a load pinned by a snapshot."""
    with engine.begin() as conn:
        pets = add_dataset(conn)
        add_samples(conn, pets, [{"key": f"a{i}", "path": f"a{i}.jpg"} for i in range(5)])
    first = load_split(engine, "pets", "train")
    with engine.begin() as conn:
        add_samples(conn, pets, [{"key": f"b{i}", "path": f"b{i}.jpg"} for i in range(4)])

    token = first.snapshot.token()
    pinned = load_split(engine, "pets", "train", snapshot=Snapshot.parse(token))
    current = load_split(engine, "pets", "train")

    assert as_rows(pinned) == as_rows(first)
    assert pinned.snapshot == first.snapshot
    assert len(current) == 9
    assert current.snapshot.max_sample_id > first.snapshot.max_sample_id


@pytest.mark.parametrize("change", ["unverify", "delete"])
def test_snapshot_read_after_a_pinned_row_is_lost_raises_snapshot_mismatch(
    engine: Engine, change: str
) -> None:
    """A pinned row that is un-verified or deleted makes the snapshot unusable, loudly."""
    with engine.begin() as conn:
        ids = add_samples(conn, add_dataset(conn), [{}] * 4)
    snapshot = load_split(engine, "pets", "train").snapshot
    with engine.begin() as conn:
        if change == "unverify":
            conn.execute(sa.update(samples).where(samples.c.id == ids[1]).values(is_verified=False))
        else:
            conn.execute(sa.delete(samples).where(samples.c.id == ids[1]))

    with pytest.raises(SnapshotMismatch, match=r"deleted or un-verified.*without a snapshot"):
        load_split(engine, "pets", "train", snapshot=snapshot)


def test_unknown_dataset_raises_not_found(engine: Engine) -> None:
    """A dataset name or version the catalog lacks is NotFound, listing what exists."""
    with engine.begin() as conn:
        add_dataset(conn, "pets", "v1")

    with pytest.raises(NotFound, match="'cats' is not in the catalog; datasets: pets"):
        load_split(engine, "cats", "train")
    with pytest.raises(NotFound, match="no version 'v9'; versions: v1"):
        load_split(engine, "pets", "train", version="v9")


def test_unknown_split_raises_not_found_listing_the_splits(engine: Engine) -> None:
    """A misspelt split is an error naming the splits that exist, not an empty load."""
    with engine.begin() as conn:
        ds = add_dataset(conn)
        add_samples(conn, ds, [{"split": "train"}, {"split": "val"}])

    with pytest.raises(NotFound, match="has no split 'trian'; splits: train, val"):
        load_split(engine, "pets", "trian")


def test_empty_split_loads_as_zero_rows_with_snapshot_zero(engine: Engine) -> None:
    """A split without verified rows gives empty arrays and the snapshot s1.0.0."""
    with engine.begin() as conn:
        add_samples(conn, add_dataset(conn), [{"is_verified": False}])

    arrays = load_split(engine, "pets", "train")

    assert len(arrays) == 0
    assert arrays.path_offsets.tolist() == [0]
    assert arrays.snapshot.token() == "s1.0.0"
    assert load_split(engine, "pets", "train", snapshot=arrays.snapshot).ids.size == 0


def test_arrays_take_at_most_64_bytes_per_sample_beyond_paths(engine: Engine) -> None:
    """The compact form: fixed-width columns plus path offsets stay within 64 B a sample."""
    with engine.begin() as conn:
        bulk_samples(conn, add_dataset(conn), "train", 1000, "img")

    arrays = load_split(engine, "pets", "train")

    assert len(arrays) == 1000
    assert arrays.bytes_per_sample_beyond_paths() <= 64
    assert arrays.nbytes == arrays.path_bytes.nbytes + 1000 * 56 + 8


@pytest.mark.parametrize("chunk_bytes", [1, 7, 150, 4096])
def test_tiny_parse_chunks_give_the_same_arrays_as_one_chunk(
    engine: Engine, chunk_bytes: int
) -> None:
    """Chunk boundaries anywhere between rows change nothing in the result."""
    with engine.begin() as conn:
        pets = add_dataset(conn)
        add_samples(conn, pets, [{"path": p, "label": 3} for p in AWKWARD_PATHS])
        bulk_samples(conn, pets, "train", 300, "bulk")

    whole = load_split(engine, "pets", "train")
    chunked = load_split(engine, "pets", "train", chunk_bytes=chunk_bytes)

    assert as_rows(chunked) == as_rows(whole)
    assert len(whole) == len(AWKWARD_PATHS) + 300


def test_snapshot_token_round_trips_and_garbage_is_invalid_argument() -> None:
    """token() and parse() are inverse; anything else is rejected with the expected form."""
    snapshot = Snapshot(max_sample_id=1_048_576, row_count=1_000_000)
    assert snapshot.token() == "s1.1048576.1000000"
    assert Snapshot.parse(snapshot.token()) == snapshot
    for garbage in ["", "s1.5", "s2.5.3", "s1.5.3.1", "s1.-5.3", "s1.3.5", "s1.٣.1", "x"]:
        with pytest.raises(InvalidArgument, match=r"s1\.<max_sample_id>\.<row_count>|impossible"):
            Snapshot.parse(garbage)


# Postgres only: the COPY path and the query plan.


def test_copy_parser_is_safe_at_every_split_of_its_input(pg_engine: Engine) -> None:
    """Feeding the real COPY output in pieces cut mid-row yields the one-piece result."""
    with pg_engine.begin() as conn:
        pets = add_dataset(conn)
        add_samples(conn, pets, [{"path": p, "label": 1} for p in AWKWARD_PATHS])
    query = split_query(pets, "train", packed=True).compile(dialect=pg_engine.dialect)
    with pg_engine.connect() as conn:
        cur = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        sql = cur.mogrify(str(query), query.params)
        out = io.BytesIO()
        cur.copy_expert(b"COPY (" + sql + b") TO STDOUT", out)
    data = out.getvalue()

    def parse(piece_bytes: int, chunk_bytes: int) -> list[tuple[Any, ...]]:
        columns = ColumnBuilder()
        parser = PackedCopyParser(columns, chunk_bytes=chunk_bytes)
        for start in range(0, len(data), piece_bytes):
            parser.write(data[start : start + piece_bytes])
        parser.close()
        snapshot = Snapshot(max_sample_id=columns.last_id, row_count=columns.row_count)
        ref = DatasetRef(id=pets, name="pets", version="v1", root="/data/pets/v1")
        return as_rows(columns.build(ref, "train", snapshot))

    whole = parse(len(data), 1 << 20)
    assert [r[6] for r in whole] == AWKWARD_PATHS
    for piece_bytes, chunk_bytes in [(1, 1), (3, 50), (89, 89), (97, 200)]:
        assert parse(piece_bytes, chunk_bytes) == whole


def explain(engine: Engine, query: sa.Select[Any]) -> str:
    compiled = query.compile(dialect=engine.dialect)
    with engine.connect() as conn:
        return "\n".join(
            conn.exec_driver_sql("EXPLAIN " + str(compiled), compiled.params).scalars()
        )


def test_split_query_plan_is_an_index_scan_on_the_split_scan_index(pg_engine: Engine) -> None:
    """With realistic statistics a split, pinned or not, streams from ix_samples_split_scan."""
    with pg_engine.begin() as conn:
        for name in ["a", "b", "c", "d"]:
            dataset_id = add_dataset(conn, name)
            for split, n in [("train", 4000), ("val", 1000)]:
                bulk_samples(conn, dataset_id, split, n, f"{name}-{split}")
        conn.execute(sa.text("ANALYZE samples"))
    arrays = load_split(pg_engine, "c", "train")
    bound = arrays.snapshot.max_sample_id

    fresh_plan = explain(pg_engine, split_query(arrays.dataset.id, "train", packed=True))
    pinned_plan = explain(
        pg_engine, split_query(arrays.dataset.id, "train", max_sample_id=bound, packed=True)
    )

    for plan in [fresh_plan, pinned_plan]:
        assert plan.startswith("Index Scan using ix_samples_split_scan on samples"), plan
        assert "Sort" not in plan, plan
    # The snapshot's bound stops the index scan; it is not a filter over later rows.
    assert f"ROW(is_verified, id) <= ROW(true, {bound})" in pinned_plan, pinned_plan


def test_a_snapshot_bound_does_not_change_the_query_plan(pg_engine: Engine) -> None:
    """Pinned and fresh loads of a split get the same plan shape, large split or small."""
    with pg_engine.begin() as conn:
        for name in ["a", "b", "c", "d"]:
            dataset_id = add_dataset(conn, name)
            for split, n in [("train", 4000), ("val", 1000)]:
                bulk_samples(conn, dataset_id, split, n, f"{name}-{split}")
        conn.execute(sa.text("ANALYZE samples"))

    for split in ["train", "val"]:
        arrays = load_split(pg_engine, "b", split)
        bound = arrays.snapshot.max_sample_id
        fresh = explain(pg_engine, split_query(arrays.dataset.id, split, packed=True))
        pinned = explain(
            pg_engine, split_query(arrays.dataset.id, split, max_sample_id=bound, packed=True)
        )
        assert [line.split("(")[0] for line in fresh.splitlines() if "cost=" in line] == [
            line.split("(")[0] for line in pinned.splitlines() if "cost=" in line
        ], (fresh, pinned)

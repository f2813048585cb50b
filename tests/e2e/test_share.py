"""Shared batches (``Loader(share=...)``) end to end: a real server, worker processes, shm.

Members are driven from one thread by stepping their iterators (``next``) in the order a
test wants: two jobs in lockstep, one that joins late, one that stalls while the other
finishes. That order is the synchronisation; nothing waits on a clock. What a test asserts
is what a member gets (every sample of its epoch exactly once, the same batches as its
group) and how often the workers decoded (the server's own count of worker results).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import batchd
from batchd import _device, errors
from batchd_server import metrics
from batchd_server.api import RunningServer

from serving import records_loader

pytestmark = pytest.mark.slow(seconds=20)

BATCH = 4
"""Records per batch: 203 records make 51 batches, more than a ring's 16 slots (prefetch 2,
2 for the loop, 12 more for small batches), so a member can fall out of another's window."""
PREFETCH = 2


def _decoded() -> float:
    """Batches of "records" the workers decoded since the test process started."""
    value = metrics.REGISTRY.get_sample_value("batchd_batch_seconds_count", {"dataset": "records"})
    return value or 0.0


def _member(server: RunningServer, share: str | None = "sweep-7", **options: Any) -> batchd.Loader:
    options.setdefault("batch_size", BATCH)
    options.setdefault("prefetch", PREFETCH)
    options.setdefault("seed", 7)
    return records_loader(server, share=share, **options)


def _ids(batches: Iterator[dict[str, Any]], n: int | None = None) -> list[list[int]]:
    """The sample ids of the next ``n`` batches (all that are left when None)."""
    out = []
    for batch in batches:
        out.append(batch["sample_id"].tolist())
        if n is not None and len(out) == n:
            break
    return out


def _lockstep(
    a: Iterator[dict[str, Any]],
    b: Iterator[dict[str, Any]],
    *,
    same: bool = True,
    until_a_ends: bool = False,
    steps: int | None = None,
) -> tuple[list, list]:
    """Both iterators to their end (``until_a_ends``: to ``a``'s, or ``steps`` steps), one
    batch of each in turn; with ``same``, the two batches of each step must hold the same
    bytes in every field (a copy is the decode it replaces)."""
    got_a, got_b = [], []
    for batch in a:
        other = next(b)
        assert batch.keys() == other.keys()
        for name in batch if same else ():
            assert torch.equal(batch[name], other[name]), f"field {name!r} differs"
        got_a.append(batch["sample_id"].tolist())
        got_b.append(other["sample_id"].tolist())
        if len(got_a) == steps:
            return got_a, got_b
    if not until_a_ends:
        assert next(b, None) is None, "the members' epochs have different lengths"
    return got_a, got_b


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _assert_one_epoch(batches: list[list[int]], records: int) -> None:
    ids = _flat(batches)
    assert len(ids) == len(set(ids)) == records, "not every sample exactly once"


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_two_members_get_the_same_epoch_once_each_decoded_once(
    server: RunningServer, transport: str
) -> None:
    """Two Loaders of one group, in lockstep: identical batches in identical order, each
    sample once per member, and the workers decode each batch once, not twice."""
    before, shares_before = _decoded(), server.sessions.shares.counts.shared
    with _member(server, transport=transport) as one, _member(server, transport=transport) as two:
        a, b = _lockstep(iter(one), iter(two))
        batches = len(one)
        assert len(server.sessions.shares) == 1, "the two sessions are one group"
    assert a == b
    _assert_one_epoch(a, 203)
    assert len(a) == batches == 51
    decoded = _decoded() - before
    copied = server.sessions.shares.counts.shared - shares_before
    # Each member's batch is either its own worker's or a copy. An inline client acks a
    # batch when it arrives, not when the loop is done with it, so now and then a member's
    # slot is freed before the other asked for its batch, and that batch is decoded twice.
    assert decoded + copied == 2 * batches
    assert decoded <= batches + batches // 10, f"{decoded} batches decoded for {batches}"
    assert len(server.sessions.shares) == 0, "a group with no members is gone"


def _segment(array: torch.Tensor | np.ndarray) -> str:
    """The file the memory of ``array`` is mapped from ("" when it is no file's)."""
    address = array.data_ptr() if isinstance(array, torch.Tensor) else array.ctypes.data
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return fields[5].removesuffix(" (deleted)") if len(fields) == 6 else ""
    raise AssertionError(f"address {address:#x} is in no mapping of this process")


@pytest.fixture
def numpy_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's loops get NumPy arrays, as without torch installed: a batch read in
    another member's ring is then a read-only view of it (with torch, a copy: a tensor
    cannot be read-only)."""
    monkeypatch.setattr(_device, "torch_or_none", lambda: None)


def test_shm_members_read_one_slot_not_copies(server: RunningServer, numpy_loop: None) -> None:
    """Over shm, the member that did not decode a batch reads it in the slot the other's
    worker wrote: both members' arrays of each step are views of one segment (the other
    member's read-only), and the server copies nothing."""
    counts = server.sessions.shares.counts
    read, copied = counts.read, counts.copied
    segments: set[str] = set()
    with _member(server) as one, _member(server) as two:
        rings = {_ring(one), _ring(two)}
        for step, (a, b) in enumerate(zip(one, two, strict=True)):
            where = _segment(a["array"])
            assert where.startswith("/dev/shm/batchd-"), "the batch is a view of a ring"
            assert _segment(b["array"]) == where, (
                step,
                counts.read - read,
                counts.copied - copied,
                counts.decoded,
            )
            mine = {_ring(one): a, _ring(two): b}
            for x in (a, b):  # a batch read in the other member's ring cannot be written
                assert x["array"].flags.writeable == (mine.get(where) is x)
            assert np.array_equal(a["array"], b["array"])
            assert np.array_equal(a["sample_id"], b["sample_id"])
            segments.add(where)
    assert counts.copied == copied, "a member's batch was copied, not read where it was"
    assert counts.read - read >= 45, f"{counts.read - read} of 51 batches read in another ring"
    # Which member's worker decodes a batch is the scheduler's choice (on 2 busy cores one
    # stream can stay ahead all epoch), so the test asks only that each batch lies in a
    # member's own ring.
    assert segments <= rings, f"batches read in {segments - rings}, no member's ring"


def test_a_torch_loop_gets_a_borrowed_batch_as_a_copy(server: RunningServer) -> None:
    """With torch, a batch read in another member's ring reaches the loop as a copy (a tensor
    cannot be read-only), equal to the owner's; the server still reads it there (a loan, no
    server copy)."""
    counts = server.sessions.shares.counts
    read, copied = counts.read, counts.copied
    with _member(server) as one, _member(server) as two:
        rings = {_ring(one), _ring(two)}
        for a, b in zip(one, two, strict=True):
            where = {_segment(a["array"]), _segment(b["array"])}
            assert len(where & rings) == 1, "one member's batch is a view of its own ring"
            assert torch.equal(a["array"], b["array"])
    assert counts.copied == copied and counts.read - read >= 45


def _ring(loader: batchd.Loader) -> str:
    """The path of ``loader``'s own ring segment."""
    session = loader._replicas.primary.session
    assert session is not None and session.transport.ring is not None
    return f"/dev/shm/{session.reply.ring.shm_name}"


def test_a_member_that_closes_keeps_the_slots_another_reads(
    server: RunningServer, numpy_loop: None
) -> None:
    """Member one closes while member two's loop holds a batch in one's ring: one's ring
    stays (the batch intact) until no member reads it any more, and two's epoch goes on,
    decoded for itself from then on; once two closes, one's ring is gone."""
    whole = _lone_epoch(server)
    with _member(server) as one, _member(server) as two:
        ring = _ring(one)
        a_iter, b_iter = iter(one), iter(two)
        _ids(a_iter, 2)  # one's stream decodes a ring's worth of batches ahead
        got = _ids(b_iter, 5)  # two, within a ring of the start, borrows them
        held = next(b_iter)
        got.append(held["sample_id"].tolist())
        assert _segment(held["array"]) == ring, "two's batch is not read in one's ring"
        expected = held["array"].copy()
        one.close()
        assert Path(ring).exists(), "one's ring went while two's loop held a batch in it"
        got += _ids(b_iter)
        assert np.array_equal(held["array"], expected), "one's slot was reused under two's batch"
        assert got == whole
        assert Path(ring).exists(), "two's loop still holds the batch"
    assert not Path(ring).exists(), "one's ring outlived the last member reading it"
    assert np.array_equal(held["array"], expected), "the client's view outlives the segment's name"


def test_without_share_each_loader_decodes_its_own(server: RunningServer) -> None:
    """The contrast: the same two Loaders without share= decode every batch twice."""
    before = _decoded()
    with _member(server, share=None) as one, _member(server, share=None) as two:
        a, b = _lockstep(iter(one), iter(two))
    assert a == b
    assert _decoded() - before == 2 * len(a)


def test_members_with_other_parameters_share_nothing(server: RunningServer) -> None:
    """The same key with another seed (or batch size) is another group: no copies, each
    member its own order."""
    before, copied = _decoded(), server.sessions.shares.counts.shared
    with _member(server, seed=7) as one, _member(server, seed=8) as two:
        a, b = _lockstep(iter(one), iter(two), same=False)
        assert len(server.sessions.shares) == 2
    assert a != b
    _assert_one_epoch(a, 203)
    _assert_one_epoch(b, 203)
    with _member(server) as one, _member(server, batch_size=5) as two:
        assert _flat(_ids(iter(two))) and _flat(_ids(iter(one)))
    assert server.sessions.shares.counts.shared == copied
    assert _decoded() - before == 2 * len(a) + 51 + 41


def _lone_epoch(server: RunningServer) -> list[list[int]]:
    """The epoch a lone Loader with the members' options gets (decoded by itself)."""
    with _member(server, share=None) as lone:
        return _ids(iter(lone))


def _join_late(
    server: RunningServer, lead: int = 30, together: int | None = None, **options: Any
) -> tuple[list[list[int]], batchd.Loader, Iterator[dict[str, Any]]]:
    """Member one takes ``lead`` batches, then member two (``options``) joins and both take
    batches in lockstep, ``together`` times or until member one's epoch ends, then member
    one closes: two's batches so far, two (left open), and its iteration."""
    with _member(server) as one:
        a_iter = iter(one)
        _ids(a_iter, lead)
        two = _member(server, **options)
        b_iter = iter(two)
        _, b = _lockstep(a_iter, b_iter, same=False, until_a_ends=True, steps=together)
    return b, two, b_iter


def _rotated(a: list[list[int]], k: int) -> list[list[int]]:
    return a[k:] + a[:k]


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_late_member_starts_at_the_groups_position(server: RunningServer, transport: str) -> None:
    """A member that joins while the other is 30 batches into the epoch starts at the
    group's position (the first batch a member still holds): it shares every batch from
    there to the end of the epoch, then wraps around to the epoch's first batches, decoded
    for itself. Its epoch is the lone Loader's rotated: every sample once."""
    whole = _lone_epoch(server)
    before, copied = _decoded(), server.sessions.shares.counts.shared
    b, two, b_iter = _join_late(server, transport=transport)
    with two:
        k = whole.index(b[0])
        # Where the group was: the batches member one's loop still holds (shm), or the
        # first its ring had not sent yet (inline acks free a slot as its batch arrives).
        assert 25 <= k <= 30 + 16, f"joined at batch {k}, not where the group was"
        b += _ids(b_iter)
        assert two.state_dict()["format"] == 2, "the next epoch is not rotated"
    assert b == _rotated(whole, k)
    _assert_one_epoch(b, 203)
    shared = server.sessions.shares.counts.shared - copied
    assert _decoded() - before + shared == 2 * 51
    # From where it joined to the end of the epoch, each batch decoded once (inline acks
    # free a slot as a batch arrives, so now and then a batch is decoded twice).
    assert shared >= (51 - k) * 3 // 4, f"{shared} of {51 - k} batches shared"


@pytest.mark.parametrize(
    ("together", "alone"), [(5, 0), (None, 15)], ids=["before-the-wrap", "after-the-wrap"]
)
@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_late_member_resumes_its_rotated_epoch(
    server: RunningServer, transport: str, together: int | None, alone: int
) -> None:
    """The late member's state records its rotation: a Loader resumed from it (in the group
    or alone) serves exactly the rest of the rotated epoch, before or after the wrap."""
    whole = _lone_epoch(server)
    b, two, b_iter = _join_late(server, together=together, transport=transport)
    with two:
        b += _ids(b_iter, alone) if alone else []
        state = two.state_dict()
        b_rest = _ids(b_iter)
    k = whole.index(b[0])
    assert b + b_rest == _rotated(whole, k)
    assert (len(b) < 51 - k) == (together is not None), "the case the test means"
    assert state["format"] == 3 and state["rotation"] == k * BATCH
    wrapped = len(b) - (51 - k)
    consumed = len(b) * BATCH if wrapped < 0 else 203 - k * BATCH + wrapped * BATCH
    assert state["consumed"] == consumed
    for share in ("sweep-7", None):
        with _member(server, share=share, transport=transport) as again:
            again.load_state_dict(state)
            assert _ids(iter(again)) == b_rest
            assert again.state_dict()["format"] == 2, "the next epoch starts unrotated"


@pytest.mark.parametrize(("together", "alone"), [(5, 0), (None, 15)])
def test_a_rotated_epoch_resumes_at_another_world_size(
    server: RunningServer, together: int | None, alone: int
) -> None:
    """An elastic resume of a rotated epoch: two ranks take the rest of its rotated order
    between them, every sample not yet served once (padding aside), none served again."""
    b, two, b_iter = _join_late(server, together=together)
    with two:
        b += _ids(b_iter, alone) if alone else []
        state = two.state_dict()
        b_rest = _ids(b_iter)
    assert state["format"] == 3
    rest = set(_flat(b_rest))
    got: list[int] = []
    for rank in range(2):
        with _member(server, share=None, rank=rank, world_size=2) as again:
            again.load_state_dict(state)
            got += _flat(_ids(iter(again)))
    assert rest <= set(got), "a sample of the rest was not served"
    extra = len(got) - len(rest)
    assert 0 <= extra < 2 * BATCH, "more than the padding of the last global batch"
    assert len(set(got) - rest) == extra, "padding is served once more at most"


def test_a_member_within_a_ring_of_the_start_is_not_rotated(server: RunningServer) -> None:
    """A member that joins while the other is 3 batches in (members started together, one a
    little late) still has the group's batches in reach of its ring: it starts at the
    epoch's first batch, as a lone Loader does, so the two get identical epochs, and it
    copies the batches the other holds."""
    copied = server.sessions.shares.counts.shared
    with _member(server) as one, _member(server) as two:
        a_iter = iter(one)
        a = _ids(a_iter, 3)
        b = _ids(iter(two))  # the whole epoch while the other waits
        a += _ids(a_iter)
    assert b == a
    _assert_one_epoch(b, 203)
    assert server.sessions.shares.counts.shared - copied >= 10


def test_a_rank_of_a_larger_job_is_not_rotated(server: RunningServer) -> None:
    """Rank 0 of a two-rank job that joins its group 20 batches in starts at the epoch's
    first batch: its ranks are each in their own group, at their own position, and must
    serve one order (their states are one global cursor), so none rotates."""
    ranks = {"rank": 0, "world_size": 2}
    with _member(server, share=None, **ranks) as lone:
        whole = _ids(iter(lone))
    assert len(whole) == 26
    with _member(server, **ranks) as one:
        a_iter = iter(one)
        _ids(a_iter, 20)
        with _member(server, **ranks) as two:
            b = _ids(iter(two))
            assert two.state_dict()["format"] == 2
    assert b == whole


def test_a_stalled_member_is_split_off_and_the_other_finishes(server: RunningServer) -> None:
    """One member stops taking batches 10 batches in; the other runs to the end of its epoch
    (it never waits for the stalled one), then the stalled one finishes: it decodes what
    it is behind on itself. Both get the same epoch, once each."""
    before, copied = _decoded(), server.sessions.shares.counts.shared
    with _member(server) as one, _member(server) as two:
        a_iter, b_iter = iter(one), iter(two)
        a, b = _lockstep_n(a_iter, b_iter, 10)
        a += _ids(a_iter)  # the whole rest of the epoch while the other member stalls
        assert len(a) == 51
        b += _ids(b_iter)
    assert a == b
    _assert_one_epoch(b, 203)
    shared = server.sessions.shares.counts.shared - copied
    decoded = _decoded() - before
    assert decoded + shared == 2 * 51
    assert decoded > 51, "the stalled member decoded the batches it fell behind on"
    assert shared >= 10


def _lockstep_n(
    a: Iterator[dict[str, Any]], b: Iterator[dict[str, Any]], n: int
) -> tuple[list[list[int]], list[list[int]]]:
    got_a, got_b = [], []
    for _ in range(n):
        got_a += _ids(a, 1)
        got_b += _ids(b, 1)
    return got_a, got_b


def test_a_resumed_member_rejoins_its_group(server: RunningServer) -> None:
    """A member saves its state 20 batches in and closes; a new Loader with the same share
    key resumes from that state beside the other member: the two halves make the group's
    epoch, each sample once, and the resumed member reads copies again."""
    with _member(server) as one:
        a_iter = iter(one)
        with _member(server) as two:
            b_iter = iter(two)
            a, b = _lockstep_n(a_iter, b_iter, 20)
            state = two.state_dict()
        copied = server.sessions.shares.counts.shared
        with _member(server) as again:
            again.load_state_dict(state)
            rest_a, rest_b = _lockstep(a_iter, iter(again))
    assert a + rest_a == b + rest_b
    _assert_one_epoch(b + rest_b, 203)
    assert server.sessions.shares.counts.shared > copied, "the resumed member shares again"


def test_a_bad_share_key_is_refused_before_anything_opens() -> None:
    for bad in ("", "two words", "x" * 129, 7):
        with pytest.raises(errors.InvalidArgument, match="share="):
            batchd.Loader("unix:///nowhere", dataset="d", batch_size=1, share=bad)  # type: ignore[arg-type]


_JOB = """
import json, sys
import batchd
with batchd.Loader(sys.argv[1], dataset="records", batch_size=4, prefetch=2, seed=7,
                   pipeline=batchd.Array((32,), "float32", raw=True), share="jobs") as loader:
    print("ready", loader.num_samples, flush=True)
    assert sys.stdin.readline() == "go\\n"
    print(json.dumps([b["sample_id"].tolist() for b in loader]), flush=True)
"""


def test_two_job_processes_share_one_epoch(server: RunningServer, tmp_path: Path) -> None:
    """Two training jobs as processes of their own, released together: the same epoch, each
    sample once in each, every batch either decoded for one of them or copied to it."""
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    before, copied = _decoded(), server.sessions.shares.counts.shared
    jobs = [
        subprocess.Popen(
            [sys.executable, str(script), server.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for job in jobs:  # each has its session open
            assert job.stdout is not None and job.stdout.readline().startswith("ready")
        for job in jobs:
            assert job.stdin is not None
            job.stdin.write("go\n")
            job.stdin.flush()
        epochs = [json.loads(job.communicate(timeout=300)[0]) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
            job.wait()
    assert [job.returncode for job in jobs] == [0, 0]
    assert epochs[0] == epochs[1]
    _assert_one_epoch(epochs[0], 203)
    shared = server.sessions.shares.counts.shared - copied
    assert _decoded() - before + shared == 2 * 51
    assert shared > 0, "the second job copied none of the first's batches"

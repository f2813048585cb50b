"""The resume contract, written once: every way of serving batches must pass it.

A training job checkpoints ``loader.state_dict()`` between batches, dies, and a new process
builds a fresh Loader and calls ``load_state_dict``; from there it must see exactly the
batches the uninterrupted run would have shown, in the same order, also across epochs. The
client tests run this against the wire double; the end-to-end tests run it against a real
server for each transport (shm, inline, shm with ``zero_copy``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import batchd

__all__ = ["assert_resume_yields_the_rest", "sample_ids"]


def sample_ids(batches: Iterable[Any]) -> list[list[int]]:
    """The sample ids of each batch, as plain lists (copies: no batch is kept)."""
    return [batch["sample_id"].tolist() for batch in batches]


def assert_resume_yields_the_rest(
    make_loader: Callable[[], batchd.Loader], *, epochs: int, stop_after: int
) -> dict[str, Any]:
    """Assert that resuming from ``state_dict()`` yields exactly the rest of the run.

    Three Loaders come from ``make_loader`` (each closed before the next opens). The first
    runs ``epochs`` epochs uninterrupted: the reference. The second stops after
    ``stop_after`` batches, possibly past the end of an epoch, and saves its state while the
    iteration is still open, as a training loop's checkpoint does. The third loads that
    state and iterates until it has served the rest of the reference's batches. The batches
    of the second, followed by those of the third, must equal the reference: the same
    samples in the same batches, in the same order.

    Args:
        make_loader: Builds a Loader; every call must give the same options (and any
            ``set_epoch`` it makes is the run's first epoch).
        epochs: Length of the run, in epochs.
        stop_after: Batches served before the state is saved; ``0 <= stop_after <`` the
            run's batches. A multiple of the epoch's length stops on an epoch boundary.

    Returns:
        The saved state, for callers that check more.
    """
    with make_loader() as loader:
        reference = [ids for _ in range(epochs) for ids in sample_ids(loader)]
    if not 0 <= stop_after < len(reference):
        raise ValueError(f"stop_after={stop_after} must be in [0, {len(reference)})")

    with make_loader() as loader:
        head: list[list[int]] = []
        while len(head) < stop_after:
            served_before = len(head)
            epoch = iter(loader)  # kept open: the state is saved mid-iteration
            for batch in epoch:
                head.append(batch["sample_id"].tolist())
                if len(head) == stop_after:
                    break
            assert len(head) > served_before, "an iteration of the interrupted run was empty"
        state = copy.deepcopy(loader.state_dict())
    assert head == reference[:stop_after], (
        f"the interrupted run's first {stop_after} batches differ from the reference's"
    )

    with make_loader() as resumed:
        resumed.load_state_dict(state)
        rest: list[list[int]] = []
        while stop_after + len(rest) < len(reference):
            served = sample_ids(resumed)
            assert served, f"an iteration after resuming from {state} yielded nothing"
            rest += served
    want = reference[stop_after:]
    if rest != want:
        first = next(
            (i for i, (a, b) in enumerate(zip(rest, want, strict=False)) if a != b),
            min(len(rest), len(want)),
        )
        raise AssertionError(
            f"resumed after {stop_after} batches (state epoch={state['epoch']}, "
            f"next_batch={state['next_batch']}): {len(rest)} batches instead of "
            f"{len(want)}; the first difference is at batch {stop_after + first} of the run: "
            f"{rest[first] if first < len(rest) else 'nothing'} instead of "
            f"{want[first] if first < len(want) else 'nothing'}"
        )
    return state

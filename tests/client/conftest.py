"""Fixtures of the client tests: no segment of theirs left behind, and the wire double."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from wire_double import WireDouble, serve_double, tagged_segments


@pytest.fixture(autouse=True)
def no_segment_left() -> Iterator[None]:
    """Every test leaves no segment of its own in /dev/shm (the client never creates any)."""
    yield
    assert tagged_segments() == []


@pytest.fixture
def double() -> Iterator[tuple[WireDouble, str]]:
    """A WireDouble on a unix socket; every session must be closed by the end of the test."""
    with serve_double() as served:
        yield served

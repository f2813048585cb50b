"""A Loader's options: checked once when built, then turned into the OpenSession request."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Final

from batchd._catalog import DEFAULT_TIMEOUT_S
from batchd._fields import AnyPipeline, any_pipeline
from batchd._packing import Pack, check_pack
from batchd._pipelines import (
    check_choice,
    check_int,
    on_error_to_proto,
    resolve_rank,
    sampling_to_proto,
)
from batchd._proto.batchd.v1 import loader_pb2
from batchd._reconnect import DEFAULT_RECONNECT_TIMEOUT_S
from batchd._server_wait import WAIT_FOR_SERVER_ENV
from batchd._sources import Mix
from batchd._wire.share import share_key_problem
from batchd._wire.specs import TRANSPORTS
from batchd.errors import InvalidArgument

__all__ = ["MAX_BATCH_SIZE", "MAX_PREFETCH", "MAX_WAIT_S", "LoaderOptions"]

MAX_BATCH_SIZE: Final = 65536
MAX_PREFETCH: Final = 1 << 16
"""The client's bound; the server may allow fewer (and says so)."""
MAX_WAIT_S: Final = 86400.0
"""The longest ``reconnect_timeout_s`` and ``wait_for_server_s``: a day."""


@dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """What a :class:`batchd.Loader` asks the server for; see its docstring for each field.

    ``rank`` and ``world_size`` are resolved when built (given, else ``torch.distributed``,
    else ``$RANK``/``$WORLD_SIZE``), and ``pipeline`` defaults to ``batchd.Image()``. Either
    ``dataset`` (with ``split``, ``version``) or ``sources`` (a :class:`batchd.Mix`) is given;
    with a mix, ``dataset`` becomes the mix's ``repr`` (for messages and saved states) and
    ``split`` is empty.

    Raises:
        InvalidArgument: (when built) a bad value, named with its valid range.
    """

    dataset: str | None = None
    split: str = "train"
    batch_size: int
    shuffle: bool = True
    seed: int = 0
    rank: int | None = None
    world_size: int | None = None
    drop_last: bool = False
    pipeline: AnyPipeline | None = None
    prefetch: int = 4
    transport: str = "auto"
    snapshot: str | None = None
    sampling: str = "uniform"
    on_error: str = "skip"
    version: str | None = None
    zero_copy: bool = False
    max_error_fraction: float = 0.01
    timeout_s: float = DEFAULT_TIMEOUT_S
    reconnect_timeout_s: float = DEFAULT_RECONNECT_TIMEOUT_S
    wait_for_server_s: float | None = None
    """None: ``$BATCHD_WAIT_FOR_SERVER_S``, else 0 (resolved when built)."""
    sources: Mix | None = None
    decode_cache: bool = True
    pack: Pack | None = None
    share: str | None = None

    def __post_init__(self) -> None:
        if self.sources is not None:
            self._check_mix(self.sources)
        elif self.dataset is None:
            raise InvalidArgument(
                "a Loader needs dataset='name' (one split) or sources=batchd.Mix({...}) "
                "(several, by weight)"
            )
        for name, text in (("dataset", self.dataset), ("split", self.split)):
            if self.sources is None and (not isinstance(text, str) or not text.strip()):
                raise InvalidArgument(f"{name}={text!r} must be a non-empty string")
        for name, optional in (("version", self.version), ("snapshot", self.snapshot)):
            if optional is not None and not isinstance(optional, str):
                raise InvalidArgument(f"{name}={optional!r} must be a string or None")
        self._set("batch_size", check_int("batch_size", self.batch_size, 1, MAX_BATCH_SIZE))
        self._set("seed", check_int("seed", self.seed, 0, (1 << 64) - 1))
        self._set("prefetch", check_int("prefetch", self.prefetch, 1, MAX_PREFETCH))
        if not 0 < self.max_error_fraction <= 1:
            raise InvalidArgument(
                f"max_error_fraction={self.max_error_fraction} must be in (0, 1]; to fail on "
                "the first bad sample use on_error='raise'"
            )
        if not self.timeout_s > 0:
            raise InvalidArgument(f"timeout_s={self.timeout_s} must be > 0 seconds")
        self._set("timeout_s", float(self.timeout_s))
        if not 0 <= self.reconnect_timeout_s <= MAX_WAIT_S:
            raise InvalidArgument(
                f"reconnect_timeout_s={self.reconnect_timeout_s} must be between 0 (never "
                f"reconnect) and {MAX_WAIT_S:g} seconds"
            )
        self._set("reconnect_timeout_s", float(self.reconnect_timeout_s))
        self._set("wait_for_server_s", _wait_for_server_s(self.wait_for_server_s))
        check_choice("transport", self.transport, TRANSPORTS)
        sampling_to_proto(self.sampling)
        on_error_to_proto(self.on_error)
        self._check_share(self.share)
        self._set("pipeline", any_pipeline(self.pipeline))
        check_pack(self.pack, self.pipeline)
        rank, world_size = resolve_rank(self.rank, self.world_size)
        self._set("rank", rank)
        self._set("world_size", world_size)
        for name in ("shuffle", "drop_last", "zero_copy"):
            self._set(name, bool(getattr(self, name)))

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def _check_share(self, share: object) -> None:
        if share is None:
            return
        if not isinstance(share, str) or not share:
            raise InvalidArgument(
                f"share={share!r} must be a non-empty string naming the group (e.g. "
                "share='sweep-7'), or None to share nothing"
            )
        problem = share_key_problem(share)
        if problem is not None:
            raise InvalidArgument(problem)

    def _check_mix(self, mix: object) -> None:
        if not isinstance(mix, Mix):
            raise InvalidArgument(
                f"sources={mix!r} must be a batchd.Mix, e.g. sources=batchd.Mix({{'a': 0.7, "
                "'b': 0.3}})"
            )
        clashes = [
            f"{name}={value!r}"
            for name, value, default in (
                ("dataset", self.dataset, None),
                ("split", self.split, "train"),
                ("version", self.version, None),
            )
            if value != default
        ]
        if clashes:
            raise InvalidArgument(
                f"a Loader over a mix takes no {', '.join(clashes)}: name each source's split "
                "in the Mix ('name:split') and its version with batchd.Source(name, split, "
                "version)"
            )
        if self.sampling != "uniform":
            raise InvalidArgument(
                f"sampling={self.sampling!r} cannot be used with a mix: the mix's weights "
                "decide how samples are drawn; leave sampling='uniform'"
            )
        self._set("dataset", repr(mix))
        self._set("split", "")

    def to_request(
        self, *, version: str | None = None, snapshot: str | None = None
    ) -> loader_pb2.OpenSessionRequest:
        """The OpenSession request, on ``version`` and ``snapshot`` when given (a reopen),
        else the options' own."""
        assert self.pipeline is not None and self.rank is not None  # set in __post_init__
        assert self.dataset is not None  # set in __post_init__
        mix = self.sources
        request = loader_pb2.OpenSessionRequest(
            dataset=self.dataset if mix is None else "",
            version=(version or self.version or "") if mix is None else "",
            split=self.split if mix is None else "",
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
            sampling=sampling_to_proto(self.sampling),
            pipeline=any_pipeline(self.pipeline)._to_proto(),
            prefetch=self.prefetch,
            snapshot=snapshot or self.snapshot or "",
            on_error=on_error_to_proto(self.on_error),
            max_error_fraction=self.max_error_fraction,
            no_decode_cache=not self.decode_cache,
            share=self.share or "",
        )
        if mix is not None:
            # A mix's versions are its sources'; a reopen's snapshot token pins them all.
            request.mix.CopyFrom(mix._to_proto())
        if self.pack is not None:
            request.pack.CopyFrom(self.pack._to_proto())
        return request

    def mix_state(self) -> dict[str, object] | None:
        """What a saved state records of the mix (None without one)."""
        return None if self.sources is None else self.sources._state()

    def pack_state(self) -> dict[str, object] | None:
        """What a saved state records of the packing (None without it)."""
        return None if self.pack is None else self.pack._state()


def _wait_for_server_s(given: object) -> float:
    """``wait_for_server_s`` as given, else ``$BATCHD_WAIT_FOR_SERVER_S`` (set and not empty),
    else 0.

    Raises:
        InvalidArgument: not a number of seconds from 0 to a day (the message names where
            the value came from).
    """
    source, value = "wait_for_server_s", given
    seconds = float("nan")
    if given is None:
        source, value = f"${WAIT_FOR_SERVER_ENV}", os.environ.get(WAIT_FOR_SERVER_ENV) or "0"
        with contextlib.suppress(ValueError):
            seconds = float(value)
    elif isinstance(given, int | float) and not isinstance(given, bool):
        seconds = float(given)
    if not 0 <= seconds <= MAX_WAIT_S:
        raise InvalidArgument(
            f"{source}={value!r} must be a number of seconds between 0 (do not wait for the "
            f"server: fail at once when it does not answer) and {MAX_WAIT_S:g}"
        )
    return seconds

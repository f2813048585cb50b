"""``batchd.Mix`` and ``batchd.Source``: one Loader over several splits, each batch by weight.

``Loader(target, sources=batchd.Mix({"laion": 0.7, "coco": 0.3}), batch_size=...)`` opens
one session over both splits. The server interleaves the sources deterministically by weight
(NOTE [ Mixed order ] in ``batchd_server/planning/mixing.py``): every batch's composition
follows the weights, each source has its own order per (seed, epoch), and the epoch ends
where the first source runs out (``stop="first"``) or after ``stop`` samples. Every batch
has a ``source`` field: each row's index into :attr:`Mix.names` (also
:attr:`batchd.Loader.sources`).

A ``schedule`` changes the weights with the global step (``batchd._wire.schedule``); it is
sent with the mix and saved in the Loader's state, so a resume replays the same batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from batchd._fields import AnyPipeline, any_pipeline
from batchd._proto.batchd.v1 import loader_pb2
from batchd._wire.mix import MAX_MIX_SOURCES, MAX_STOP, finite_sum, valid_weight
from batchd._wire.schedule import WeightSchedule
from batchd.errors import InvalidArgument

__all__ = ["Mix", "Source"]


@dataclass(frozen=True)
class Source:
    """A split of a dataset version, as one source of a :class:`Mix`.

    A string stands for a Source too: ``"name"`` is ``Source("name")`` and ``"name:split"`` is
    ``Source("name", "split")`` (the split follows the last colon). Use a Source for a
    dataset whose name holds a colon, to pin a ``version``, or to decode this source with a
    ``pipeline`` of its own (other augmentations, or the same arrays stored otherwise): it
    must give the same batch fields (names, dtypes, shapes) as the Loader's pipeline, and a
    pipeline that works on the whole batch (``Tokens``, ``Custom``) must be the Loader's own.

    Raises:
        InvalidArgument: an empty or non-string name.
    """

    dataset: str
    split: str = "train"
    version: str | None = None
    """The dataset version; default the newest."""
    pipeline: AnyPipeline | None = None
    """This source's pipeline; default the Loader's."""

    def __post_init__(self) -> None:
        for what, text in (("dataset", self.dataset), ("split", self.split)):
            if not isinstance(text, str) or not text.strip():
                raise InvalidArgument(f"a mix source's {what}={text!r} must be a non-empty string")
        if self.version is not None and (not isinstance(self.version, str) or not self.version):
            raise InvalidArgument(
                f"a mix source's version={self.version!r} must be a non-empty string or None"
            )
        if self.pipeline is not None:
            object.__setattr__(self, "pipeline", any_pipeline(self.pipeline))

    @classmethod
    def parse(cls, text: str) -> Source:
        """The Source a ``"name"`` or ``"name:split"`` string stands for."""
        if not isinstance(text, str):
            raise InvalidArgument(
                f"a mix source must be a 'name', 'name:split' or batchd.Source, not {text!r}"
            )
        dataset, colon, split = text.rpartition(":")
        if not colon:
            return cls(text)
        if not dataset or not split:
            raise InvalidArgument(
                f"mix source {text!r} is not 'name' or 'name:split'; for a dataset whose name "
                "ends in ':' use batchd.Source(name, split)"
            )
        return cls(dataset, split)

    @property
    def name(self) -> str:
        """``dataset``, ``dataset:split`` when the split is not "train", ``@version`` added
        when pinned."""
        text = self.dataset if self.split == "train" else f"{self.dataset}:{self.split}"
        return f"{text}@{self.version}" if self.version else text


SourceLike: TypeAlias = str | Source
SchedulePoint: TypeAlias = tuple[
    int, Mapping[SourceLike, float] | Iterable[tuple[SourceLike, float]]
]


class Mix:
    """Several splits served as one Loader's epoch, each batch drawn by weight.

    Args:
        weights: Source → weight, as a mapping or as ``(source, weight)`` pairs, in the order
            the batch's ``source`` field numbers them. A source is ``"name"``,
            ``"name:split"`` or a :class:`Source`; a weight is a finite number > 0, and a
            source's share of every batch (and of the epoch) is its weight over the sum.
        stop: ``"first"`` (default): the epoch ends where the first source runs out, so no
            sample of any source repeats within an epoch. An int N: every epoch has N samples
            (all ranks together), and a source that runs out starts over in a new order.
        schedule: Weights that change as training goes on: ``(step, weights)`` points in
            increasing steps, each weighing every source of the mix (by the same names; a
            weight may be 0 there). A step is a global batch (one batch on every rank):
            batch k of epoch e is step ``e * len(loader) + k``. See ``interpolate``.
        interpolate: ``"step"`` (default): from a point's step on, its weights;
            ``"linear"``: the straight line between consecutive points. Before the first
            point, ``weights``. With a schedule, every epoch is as long as ``weights`` make
            it, and a source the schedule favours may start another pass over its samples
            (in a new order) before the epoch ends.

    Every source goes through the Loader's pipeline unless its :class:`Source` brings one
    with the same fields. Sampling is ``"uniform"`` within each source, shuffled per (seed,
    epoch, source) when the Loader shuffles.

    Raises:
        InvalidArgument: no source, a bad name or weight, a source listed twice, a bad
            ``stop``, or a bad schedule (steps not increasing, a weight < 0, a source the
            mix does not have or a point that leaves one out).
    """

    def __init__(
        self,
        weights: Mapping[SourceLike, float] | Iterable[tuple[SourceLike, float]],
        *,
        stop: str | int = "first",
        schedule: Sequence[SchedulePoint] | None = None,
        interpolate: str = "step",
    ) -> None:
        pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
        if not pairs:
            raise InvalidArgument(
                "Mix needs at least one source and its weight, e.g. Mix({'a': 0.7, 'b': 0.3})"
            )
        if len(pairs) > MAX_MIX_SOURCES:
            raise InvalidArgument(f"Mix has {len(pairs)} sources; at most {MAX_MIX_SOURCES}")
        sources: list[Source] = []
        names: list[str] = []
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise InvalidArgument(f"Mix takes (source, weight) pairs; got {pair!r}")
            key, weight = pair
            source = key if isinstance(key, Source) else Source.parse(key)
            if source in sources:
                raise InvalidArgument(
                    f"Mix lists {source.name!r} twice; list it once with the sum of the weights"
                )
            if not valid_weight(weight):
                raise InvalidArgument(
                    f"Mix weight {weight!r} of {source.name!r} must be a finite number > 0 "
                    "(leave a source out rather than weigh it 0)"
                )
            sources.append(source)
            names.append(key if isinstance(key, str) else source.name)
        if not finite_sum(w for _, w in pairs):
            raise InvalidArgument(
                f"Mix weights {[w for _, w in pairs]!r} add up to more than the largest float; "
                "scale them down (only their ratios matter), e.g. to shares that sum to 1"
            )
        if stop != "first" and (
            isinstance(stop, bool) or not isinstance(stop, int) or not 1 <= stop <= MAX_STOP
        ):
            raise InvalidArgument(
                f"Mix stop={stop!r} must be 'first' (the epoch ends where the first source "
                f"runs out) or a number of samples per epoch from 1 to {MAX_STOP}"
            )
        self._sources = tuple(sources)
        self._weights = tuple(float(w) for _, w in pairs)
        self._names = tuple(names)
        self._stop: str | int = stop
        self._schedule = (
            None
            if schedule is None
            else WeightSchedule(self._weights, self._points(schedule), interpolate)
        )
        if schedule is None and interpolate != "step":
            raise InvalidArgument(
                f"Mix interpolate={interpolate!r} needs a schedule; give schedule=[(step, "
                "weights), ...]"
            )

    def _points(
        self, schedule: Sequence[SchedulePoint]
    ) -> tuple[tuple[int, tuple[float, ...]], ...]:
        """The schedule's points with weights in source order, each naming every source."""
        if isinstance(schedule, str | bytes | Mapping) or not isinstance(schedule, Sequence):
            raise InvalidArgument(
                f"Mix schedule must be a list of (step, weights) points, not {schedule!r}"
            )
        points = []
        for point in schedule:
            if not (isinstance(point, tuple | list) and len(point) == 2):
                raise InvalidArgument(
                    f"a Mix schedule point is (step, {{source: weight}}); got {point!r}"
                )
            step, weights = point
            if not isinstance(weights, Mapping | Iterable) or isinstance(weights, str | bytes):
                raise InvalidArgument(
                    f"the Mix schedule point at step {step!r} has weights {weights!r}; give "
                    "{source: weight, ...} for every source of the mix"
                )
            pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
            given: dict[Source, float] = {}
            for pair in pairs:
                if not (isinstance(pair, tuple) and len(pair) == 2):
                    raise InvalidArgument(
                        f"the Mix schedule point at step {step!r} takes (source, weight) "
                        f"pairs; got {pair!r}"
                    )
                key, weight = pair
                source = key if isinstance(key, Source) else Source.parse(key)
                if source not in self._sources:
                    raise InvalidArgument(
                        f"the Mix schedule point at step {step!r} names {source.name!r}, which "
                        f"is not a source of the mix ({', '.join(self._names)})"
                    )
                if source in given:
                    raise InvalidArgument(
                        f"the Mix schedule point at step {step!r} lists {source.name!r} twice"
                    )
                given[source] = weight
            missing = [n for s, n in zip(self._sources, self._names, strict=True) if s not in given]
            if missing:
                raise InvalidArgument(
                    f"the Mix schedule point at step {step!r} leaves out {', '.join(missing)}; "
                    "every point weighs every source of the mix (0 to leave one out there)"
                )
            points.append((step, tuple(given[s] for s in self._sources)))
        return tuple(points)

    @property
    def sources(self) -> tuple[Source, ...]:
        return self._sources

    @property
    def weights(self) -> tuple[float, ...]:
        return self._weights

    @property
    def names(self) -> tuple[str, ...]:
        """Each source's name as given; a batch's ``source`` field indexes these."""
        return self._names

    @property
    def stop(self) -> str | int:
        return self._stop

    @property
    def schedule(self) -> WeightSchedule | None:
        """The weights by global step; None: ``weights`` throughout."""
        return self._schedule

    def _to_proto(self) -> loader_pb2.Mix:
        sources = []
        for s, w in zip(self._sources, self._weights, strict=True):
            source = loader_pb2.MixSource(
                dataset=s.dataset, version=s.version or "", split=s.split, weight=w
            )
            if s.pipeline is not None:
                source.pipeline.CopyFrom(any_pipeline(s.pipeline)._to_proto())
            sources.append(source)
        stop = 0 if self._stop == "first" else int(self._stop)
        mix = loader_pb2.Mix(sources=sources, stop_samples=stop)
        if self._schedule is not None:
            for step, weights in self._schedule.points:
                mix.schedule.add(step=step, weights=weights)
            mix.interpolate = self._schedule.interpolate
        return mix

    def _state(self) -> dict[str, Any]:
        """What a saved state records of the mix: plain values, compared on resume."""
        return {
            "sources": [
                [s.dataset, s.split, s.version or "", w]
                for s, w in zip(self._sources, self._weights, strict=True)
            ],
            "stop": self._stop,
            **self._schedule_state(),
        }

    def _schedule_state(self) -> dict[str, Any]:
        # Only with a schedule: a state saved by a Loader without one still compares equal.
        if self._schedule is None:
            return {}
        return {
            "schedule": [[step, list(w)] for step, w in self._schedule.points],
            "interpolate": self._schedule.interpolate,
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mix):
            return NotImplemented
        return (self._sources, self._weights, self._stop, self._schedule) == (
            other._sources,
            other._weights,
            other._stop,
            other._schedule,
        )

    def __hash__(self) -> int:
        return hash((self._sources, self._weights, self._stop, self._schedule))

    def __repr__(self) -> str:
        inner = ", ".join(f"{n!r}: {w:g}" for n, w in zip(self._names, self._weights, strict=True))
        stop = "" if self._stop == "first" else f", stop={self._stop}"
        if self._schedule is not None:
            stop += f", schedule=<{len(self._schedule.points)} points>"
            stop += f", interpolate={self._schedule.interpolate!r}"
        return f"Mix({{{inner}}}{stop})"

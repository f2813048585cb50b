"""Build a session's pipeline from its spec: the built-in kinds or a registered custom decoder.

Custom decoders are Python callables registered by name through the entry-point group
``batchd.decoders`` of any distribution installed beside the server, for example in its
``pyproject.toml``::

    [project.entry-points."batchd.decoders"]
    spectrogram = "mypkg.decoders:Spectrogram"

The callable receives the spec's ``options`` as keyword arguments and returns a
:class:`~batchd_server.pipelines.base.Pipeline`. Its ``decode_into`` may raise
:class:`~batchd_server.pipelines.base.BadSample`; anything else it raises becomes
``BadSample("decoder")``, so a buggy decoder costs samples, never workers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Final

from batchd_server.errors import InvalidArgument
from batchd_server.pipelines.array import ArrayPipeline
from batchd_server.pipelines.audio import AudioPipeline
from batchd_server.pipelines.base import BadSample, Block, FieldSpec, Pipeline, SampleInfo
from batchd_server.pipelines.chat import ChatPipeline
from batchd_server.pipelines.fields import FIELDS, FieldsPipeline
from batchd_server.pipelines.image import ImagePipeline
from batchd_server.pipelines.text import TextPipeline
from batchd_server.pipelines.tokens import TokensPipeline
from batchd_server.pipelines.types import Bytes, Offsets
from batchd_server.pipelines.video import VideoPipeline

__all__ = ["BUILTIN", "CUSTOM", "ENTRY_POINT_GROUP", "build_pipeline", "registered_decoders"]

BUILTIN: Final[Mapping[str, Callable[..., Pipeline]]] = {
    "image": ImagePipeline,
    "array": ArrayPipeline,
    "tokens": TokensPipeline,
    "text": TextPipeline,
    "chat": ChatPipeline,
    "video": VideoPipeline,
    "audio": AudioPipeline,
}
CUSTOM: Final = "custom"
ENTRY_POINT_GROUP: Final = "batchd.decoders"
_RESERVED_FIELDS: Final = frozenset({"sample_id", "label"})
"""Added by the worker to every batch."""


def registered_decoders() -> list[str]:
    """Names of the custom decoders installed on this server, sorted."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def build_pipeline(kind: str, options: Mapping[str, Any]) -> Pipeline:
    """The pipeline a session's spec describes.

    Args:
        kind: ``"image"``, ``"array"``, ``"tokens"``, ``"text"``, ``"chat"``, ``"video"``,
            ``"audio"`` (``options``
            are the constructor's keyword arguments) or ``"custom"`` (``options["name"]``
            is the registered decoder, ``options.get("options", {})`` its keyword arguments).
        options: As above.

    Raises:
        InvalidArgument: Unknown kind or decoder, bad options, or a decoder that fails to
            load, raises, or returns something that is not a Pipeline.
    """
    if kind == CUSTOM:
        return _build_custom(options)
    if kind == FIELDS:
        fields = options.get("fields")
        if not isinstance(fields, list | tuple) or not all(isinstance(f, Mapping) for f in fields):
            raise InvalidArgument(
                "a fields pipeline needs options {'fields': [{...}, ...]}, got "
                f"{dict(options)!r}"
            )
        pipeline: Pipeline = FieldsPipeline(fields, build_pipeline)
        _check_fields("fields pipeline", pipeline)
        return pipeline
    factory = BUILTIN.get(kind)
    if factory is None:
        kinds = ", ".join(sorted([*BUILTIN, CUSTOM, FIELDS]))
        raise InvalidArgument(f"pipeline kind {kind!r} is unknown; kinds: {kinds}")
    _check_keywords(f"{kind} pipeline", factory, options)
    try:
        pipeline = factory(**options)
    except InvalidArgument:
        raise
    except (TypeError, ValueError) as e:  # a value of the wrong type deeper in a constructor
        raise InvalidArgument(f"{kind} pipeline options {dict(options)!r}: {e}") from e
    _check_fields(f"{kind} pipeline", pipeline)
    return pipeline


def _build_custom(options: Mapping[str, Any]) -> Pipeline:
    name = options.get("name")
    kwargs = options.get("options", {})
    if not isinstance(name, str) or not isinstance(kwargs, Mapping):
        raise InvalidArgument(
            "a custom pipeline needs options {'name': <registered decoder>, "
            f"'options': {{...}}}}, got {dict(options)!r}"
        )
    found = _entry_point(name)
    what = f"custom decoder {name!r} ({found.value})"
    try:
        factory = found.load()
    except Exception as e:
        raise InvalidArgument(f"{what} cannot be imported on this server: {e!r}") from e
    try:
        pipeline = factory(**kwargs)
    except InvalidArgument:
        raise
    except Exception as e:
        raise InvalidArgument(f"{what} rejected options {dict(kwargs)!r}: {e!r}") from e
    if not isinstance(pipeline, Pipeline):
        raise InvalidArgument(
            f"{what} returned {type(pipeline).__name__}, not a batchd_server Pipeline"
        )
    _check_fields(what, pipeline)
    return _Guarded(name, pipeline)


def _entry_point(name: str) -> EntryPoint:
    found = {ep.value: ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name}
    if not found:
        have = ", ".join(registered_decoders()) or "none"
        raise InvalidArgument(
            f"custom decoder {name!r} is not registered on this server (entry-point group "
            f"{ENTRY_POINT_GROUP!r}); registered: {have}. Install the package that provides "
            "it into the server's environment"
        )
    if len(found) > 1:
        raise InvalidArgument(
            f"custom decoder {name!r} is registered more than once: {sorted(found)}; "
            "uninstall all but one"
        )
    return next(iter(found.values()))


def _check_keywords(what: str, factory: Callable[..., Any], options: Mapping[str, Any]) -> None:
    params = inspect.signature(factory).parameters
    unknown = sorted(set(options) - set(params))
    missing = sorted(
        n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in options
    )
    if unknown or missing:
        raise InvalidArgument(
            f"{what}: unknown options {unknown}, missing options {missing}; it takes {list(params)}"
        )


def _check_fields(what: str, pipeline: Pipeline) -> None:
    try:
        fields = pipeline.fields()
    except Exception as e:
        raise InvalidArgument(f"{what}: fields() raised {e!r}") from e
    names = [f.name for f in fields] if isinstance(fields, list) else []
    if (
        not names
        or not all(isinstance(f, FieldSpec) for f in fields)
        or len(set(names)) != len(names)
        or _RESERVED_FIELDS & set(names)
    ):
        raise InvalidArgument(
            f"{what}: fields() must return a non-empty list of FieldSpec with unique names, "
            f"none of {sorted(_RESERVED_FIELDS)}; got {fields!r}"
        )


class _Guarded(Pipeline):
    """A custom pipeline whose decode errors are all BadSample."""

    def __init__(self, name: str, inner: Pipeline) -> None:
        self.name = name
        self.inner = inner

    def fields(self) -> list[FieldSpec]:
        return self.inner.fields()

    def decode_into(self, data: memoryview, sample: SampleInfo, row: Block) -> None:
        try:
            self.inner.decode_into(data, sample, row)
        except BadSample:
            raise
        except Exception as e:
            raise BadSample(
                "decoder",
                f"{sample.path}: custom decoder {self.name!r} raised {type(e).__name__}: {e}",
            ) from e

    def decode_batch(self, data: Bytes, starts: Offsets, lengths: Offsets, block: Block) -> bool:
        try:
            return bool(self.inner.decode_batch(data, starts, lengths, block))
        except Exception:  # the sample-by-sample decode that follows reports what is wrong
            return False

    def finish(self, block: Block, rows: int) -> dict[str, tuple[int, ...]]:
        return self.inner.finish(block, rows)

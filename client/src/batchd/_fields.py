"""Samples of several fields: a pipeline per field, composed (:class:`Fields`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from batchd._pipelines import PipelineSpec, pipeline_or_default
from batchd._proto.batchd.v1 import loader_pb2
from batchd.errors import InvalidArgument

__all__ = ["AnyPipeline", "Field", "Fields", "any_pipeline"]

_RESERVED = frozenset({"sample_id", "label", "source"})
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclass(frozen=True)
class Field:
    """One field of a sample: where its bytes come from and what decodes them.

    Args:
        source: A tar member's extension (``"jpg"``, ``"txt"``, ``"mp4"``; a leading dot is
            dropped) for WebDataset shards, or a column (``"caption"``, ``"image.bytes"``)
            for Parquet files.
        pipeline: What decodes it: :class:`batchd.Image`, :class:`batchd.Text`, ... (not
            :class:`Fields`).
        optional: A sample without it is served with this field's rows zero and
            ``<name>.present`` 0, instead of being a bad sample of kind ``missing_field``.
    """

    source: str
    pipeline: PipelineSpec
    optional: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip(". \t"):
            raise InvalidArgument(
                f"Field source={self.source!r} must name a tar member's extension (jpg, txt) "
                "or a Parquet column"
            )
        if isinstance(self.pipeline, Fields | Mapping):
            raise InvalidArgument("a Field's pipeline decodes one field; it cannot be Fields")
        object.__setattr__(self, "pipeline", pipeline_or_default(self.pipeline))
        object.__setattr__(self, "optional", bool(self.optional))


@dataclass(frozen=True, init=False)
class Fields:
    """Samples of several fields, each decoded by its own pipeline.

    ``Fields(image=Field("jpg", Image(size=224)), caption=Field("txt", Text(tok, max_len=77)))``,
    or the same as a dict passed as a Loader's ``pipeline``. A bare pipeline (not a
    :class:`Field`) reads the member or column named like the field.

    A batch has, for each field, its pipeline's first output under the field's name
    (``image``: ``[B, 3, 224, 224]``; ``caption``: the token ids ``[B, L]``) and its other
    outputs as ``<name>.<output>`` (``caption.attention_mask``, ``caption.length``), beside
    ``sample_id`` and ``label``.
    """

    fields: tuple[tuple[str, Field], ...]

    def __init__(
        self, fields: Mapping[str, Field | PipelineSpec] | None = None, /, **named: Any
    ) -> None:
        given: dict[str, Any] = {**(fields or {}), **named}
        if not given:
            raise InvalidArgument("Fields needs at least one field")
        out: list[tuple[str, Field]] = []
        for name, spec in given.items():
            if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARS:
                raise InvalidArgument(f"field name {name!r} must be letters, digits, '_' or '-'")
            if name in _RESERVED:
                raise InvalidArgument(
                    f"field name {name!r} is taken: every batch has sample_id and label (the "
                    "catalog's label, from a .cls member or a label column), and a mix's "
                    "source; name the field otherwise"
                )
            out.append((name, spec if isinstance(spec, Field) else Field(name, spec)))
        object.__setattr__(self, "fields", tuple(out))

    def _to_proto(self) -> loader_pb2.Pipeline:
        return loader_pb2.Pipeline(
            fields=loader_pb2.FieldsPipeline(
                fields=[
                    loader_pb2.SampleField(
                        name=name,
                        source=f.source.strip(" \t").removeprefix("."),
                        optional=f.optional,
                        pipeline=f.pipeline._to_proto(),
                    )
                    for name, f in self.fields
                ]
            )
        )


AnyPipeline: TypeAlias = PipelineSpec | Fields | Mapping[str, Field | PipelineSpec]
"""What a Loader's ``pipeline`` may be: one pipeline, or a pipeline per field."""


def any_pipeline(pipeline: object) -> PipelineSpec | Fields:
    """``pipeline`` as a spec (a dict of fields as :class:`Fields`; None as ``Image()``)."""
    if isinstance(pipeline, Fields):
        return pipeline
    if isinstance(pipeline, Mapping):
        return Fields(pipeline)
    return pipeline_or_default(pipeline)

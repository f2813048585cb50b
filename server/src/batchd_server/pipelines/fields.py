"""A sample of several fields (an image and its caption, a clip's video and audio): one
pipeline per field, composed.

Each field has a name, a source (where its bytes come from: a tar member's extension, a
Parquet column; ``workers/fields.py`` opens it) and a pipeline of its own. In the batch, a
field's pipeline's first output is named by the field (``image``, ``caption``) and its other
outputs ``<field>.<output>`` (``caption.attention_mask``, ``caption.length``); an optional
field adds ``<field>.present`` (uint8, 0 where the sample has no such field and its rows are
zero).

The worker decodes each field through a :class:`FieldView` (the field's pipeline writing
into the batch's own arrays under their outer names), and :class:`FieldsPipeline` finishes
the batch by finishing each field's pipeline on its own arrays (tokens pad to the longest).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from batchd_server.errors import InvalidArgument
from batchd_server.pipelines.base import Block, FieldSpec, Pipeline, SampleInfo
from batchd_server.pipelines.types import Bytes, Offsets

__all__ = ["FIELDS", "FieldView", "FieldsPipeline", "present_name"]

FIELDS: Final = "fields"
"""The kind of a pipeline of several fields (``build_pipeline``)."""
_RESERVED: Final = frozenset({"sample_id", "label", "source"})
_NAME_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def present_name(field: str) -> str:
    """The batch field that says which rows have an optional ``field``."""
    return f"{field}.present"


@dataclass(frozen=True)
class FieldView:
    """One field's pipeline, reading and writing the batch's arrays by their outer names."""

    name: str
    source: str
    optional: bool
    pipeline: Pipeline
    names: tuple[tuple[str, str], ...]
    """(the pipeline's own name, the batch's name) of each of its outputs."""

    @property
    def present(self) -> str | None:
        return present_name(self.name) if self.optional else None

    def inner(self, block: Block) -> Block:
        """``block``'s arrays of this field, under the names its pipeline knows."""
        return {own: block[outer] for own, outer in self.names}

    def fields(self) -> list[FieldSpec]:
        renamed = dict(self.names)
        specs = [FieldSpec(renamed[f.name], f.dtype, f.shape) for f in self.pipeline.fields()]
        if self.optional:
            specs.append(FieldSpec(present_name(self.name), np.dtype(np.uint8), ()))
        return specs

    def decode_into(self, data: memoryview, sample: SampleInfo, row: Block) -> None:
        self.pipeline.decode_into(data, sample, self.inner(row))

    def decode_batch(self, data: Bytes, starts: Offsets, lengths: Offsets, block: Block) -> bool:
        return self.pipeline.decode_batch(data, starts, lengths, self.inner(block))

    def mark(self, block: Block, rows: slice | tuple[()], present: bool) -> None:
        """Say whether ``rows`` have this field (an optional one's ``present``); a row
        without it is zero."""
        if not self.optional:
            return
        block[present_name(self.name)][rows] = present
        if not present:
            for _, outer in self.names:
                block[outer][rows] = 0


class FieldsPipeline(Pipeline):
    """The pipeline of a sample of several fields (see the module docs).

    Args:
        fields: Each field as ``{"name", "source", "optional", "kind", "options"}`` (kind
            and options: its pipeline's, as ``build_pipeline`` takes them).
        build: ``build_pipeline`` (passed in: the registry imports this module).
    """

    def __init__(
        self,
        fields: Sequence[Mapping[str, Any]],
        build: Callable[[str, Mapping[str, Any]], Pipeline],
    ) -> None:
        if not fields:
            raise InvalidArgument("a pipeline of fields needs at least one field")
        views: list[FieldView] = []
        for spec in fields:
            name, source = str(spec.get("name", "")), str(spec.get("source", ""))
            if not name or not set(name) <= _NAME_CHARS or name in _RESERVED:
                raise InvalidArgument(
                    f"field name {name!r} must be letters, digits, '_' or '-', and none of "
                    f"{sorted(_RESERVED)} (the worker adds those)"
                )
            if not source.strip():
                raise InvalidArgument(
                    f"field {name!r} needs a source: a tar member's extension (jpg, txt) or a "
                    "Parquet column"
                )
            kind = str(spec.get("kind", ""))
            if kind == FIELDS:
                raise InvalidArgument(f"field {name!r}: a field's pipeline cannot be fields")
            pipeline = build(kind, spec.get("options", {}))
            own = [f.name for f in pipeline.fields()]
            outer = [name, *(f"{name}.{n}" for n in own[1:])]
            views.append(
                FieldView(
                    name,
                    source.strip(),
                    bool(spec.get("optional")),
                    pipeline,
                    tuple(zip(own, outer, strict=True)),
                )
            )
        names = [f.name for v in views for f in v.fields()]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"fields make the batch fields {names}, some twice; rename one")
        self.views: tuple[FieldView, ...] = tuple(views)

    def fields(self) -> list[FieldSpec]:
        return [f for v in self.views for f in v.fields()]

    def decode_into(self, data: memoryview, sample: SampleInfo, row: Block) -> None:
        raise AssertionError("each field is decoded by its own view (workers/fields.py)")

    def finish(self, block: Block, rows: int) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        for view in self.views:
            own = view.pipeline.finish(view.inner(block), rows)
            renamed = dict(view.names)
            shapes.update((renamed[name], shape) for name, shape in own.items())
            if view.optional:
                shapes[present_name(view.name)] = (rows,)
        return shapes

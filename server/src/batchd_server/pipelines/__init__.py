"""Decode pipelines: sample bytes to rows of a batch.

Workers build one pipeline per session with :func:`build_pipeline`, read each sample's bytes
through a source's reader (``storage/reader.py``), and call :meth:`Pipeline.decode_into` per
sample, treating :class:`BadSample` as the only error a sample can cause.
"""

from __future__ import annotations

from batchd_server.pipelines.array import ArrayPipeline
from batchd_server.pipelines.audio import AudioPipeline
from batchd_server.pipelines.base import BadSample, FieldSpec, Pipeline, SampleInfo, sample_rng
from batchd_server.pipelines.chat import ChatPipeline
from batchd_server.pipelines.image import ImagePipeline
from batchd_server.pipelines.registry import (
    BUILTIN,
    ENTRY_POINT_GROUP,
    build_pipeline,
    registered_decoders,
)
from batchd_server.pipelines.text import TextPipeline
from batchd_server.pipelines.tokens import TokensPipeline
from batchd_server.pipelines.video import VideoPipeline

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "ArrayPipeline",
    "AudioPipeline",
    "BadSample",
    "ChatPipeline",
    "FieldSpec",
    "ImagePipeline",
    "Pipeline",
    "SampleInfo",
    "TextPipeline",
    "TokensPipeline",
    "VideoPipeline",
    "build_pipeline",
    "registered_decoders",
    "sample_rng",
]

"""What the video and audio pipelines share: opening a sample's bytes with PyAV and turning
what FFmpeg says about hostile input into a :class:`BadSample` of a named kind.

PyAV (the ``av`` distribution) bundles its own FFmpeg build, so the server's image needs no
system FFmpeg and decodes the same on every machine; torchcodec, PyTorch's own decoder, is
built against one torch release at a time, and the server's torch pin moves faster than its
releases (see ``docs/media.md``).

Kinds of bad media:

- ``corrupt``: FFmpeg does not recognise the bytes as a container, or the container has no
  stream of the kind the pipeline decodes (a text file, an image, a video without audio for
  :class:`~batchd_server.pipelines.audio.AudioPipeline`). A file cut short before its header
  is complete (an MP4 whose ``moov`` atom was at the end) is one of these: FFmpeg cannot tell.
- ``truncated``: the header is read, but the stream ends (or stops decoding) before the
  frames or samples the sample must give.
- ``empty``: the header promises no frames or no samples at all.
- ``too_large``: frames larger than :data:`MAX_FRAME_PIXELS`, or more decoding than the
  bounds of each pipeline allow (a clip whose nearest keyframe is absurdly far back).

Every decode loop is bounded by a count of frames, so hostile input costs a bounded amount of
work: never a hang. The bytes themselves are bounded by ``--max-sample-bytes`` before they
reach a pipeline, and the output by the pipeline's field shapes.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, Final

from batchd_server.pipelines.base import BadSample, SampleInfo

if TYPE_CHECKING:
    import av.container

__all__ = ["MAX_FRAME_PIXELS", "decode_error", "open_media", "stream_of", "unexpected"]

MAX_FRAME_PIXELS: Final = 8192 * 8192
"""Larger frames are ``too_large``: one such frame is 100 MB decoded."""


def open_media(data: memoryview, sample: SampleInfo) -> av.container.InputContainer:
    """The sample's bytes as an open PyAV container (read from memory: no file is opened).

    Raises:
        BadSample: ``corrupt``: FFmpeg cannot read a container from them.
    """
    import av  # here: the server's own process builds pipelines without decoding anything

    if not len(data):
        raise BadSample("empty", f"{sample.path}: the file is empty (0 bytes)")
    try:
        # PyAV reads a file-like object through its own AVIOContext: a bytes copy is the
        # one allocation (BytesIO cannot wrap a memoryview without one).
        return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except Exception as e:  # FFmpeg's errors on hostile bytes are many kinds of av.FFmpegError
        raise BadSample(
            "corrupt",
            f"{sample.path}: not a media file FFmpeg can read ({type(e).__name__}: {e}); "
            "a file cut short before its header ends looks the same",
        ) from e


def stream_of(container: av.container.InputContainer, kind: str, sample: SampleInfo) -> Any:
    """The first ``kind`` (``"video"`` or ``"audio"``) stream, with threads off.

    Raises:
        BadSample: ``corrupt``: the container has no such stream.
    """
    streams = container.streams.video if kind == "video" else container.streams.audio
    if not streams:
        have = ", ".join(s.type for s in container.streams) or "no streams"
        raise BadSample("corrupt", f"{sample.path}: no {kind} stream (it has {have})")
    stream: Any = streams[0]
    if stream.codec_context is None:
        raise BadSample("corrupt", f"{sample.path}: its {kind} stream has no decoder FFmpeg knows")
    # One decode thread: the server runs one worker process per core already.
    stream.codec_context.thread_count = 1
    return stream


def unexpected(e: Exception, sample: SampleInfo) -> BadSample:
    """Anything else PyAV raised on hostile bytes (an attribute a damaged header left unset,
    a value out of range): the file is not media this pipeline can decode."""
    return BadSample("corrupt", f"{sample.path}: damaged media ({type(e).__name__}: {e})")


def decode_error(e: Exception, sample: SampleInfo, what: str) -> BadSample:
    """A decode failure after the header was read: the stream is cut or damaged."""
    return BadSample(
        "truncated",
        f"{sample.path}: the stream stops decoding {what} ({type(e).__name__}: {e}); "
        "the file is cut short or damaged",
    )

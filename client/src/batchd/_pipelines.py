"""Pipeline specs (``batchd.Image``, ``Array``, ``Tokens``, ``Text``, ``Chat``, ``Custom``) and
the Loader's choices.

A spec says what each sample decodes to on the server. Specs are frozen dataclasses that
validate themselves when built, so a mistake fails in the training script's first line, not
in a worker on the server; ``_to_proto()`` turns one into the wire's ``Pipeline`` message.
The string choices of :class:`batchd.Loader` (``sampling``, ``on_error``, ``transport``) are
checked and translated here too, as is the process's rank, so every value the client sends
is validated in one file.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

import numpy as np

from batchd._checks import check_choice, check_int
from batchd._media import Audio, Video
from batchd._proto.batchd.v1 import loader_pb2
from batchd._wire.specs import (
    IMAGE_DECODERS,
    IMAGE_DEFAULT_RATIO,
    IMAGE_DEFAULT_SCALE,
    IMAGE_DEFAULT_SIZE,
    MAX_IMAGE_SIZE,
    MAX_TOKENS,
    ON_ERROR_CHOICES,
)
from batchd.errors import InvalidArgument

__all__ = [
    "ON_ERROR_POLICIES",
    "SAMPLING_MODES",
    "Array",
    "Chat",
    "Custom",
    "Image",
    "PipelineSpec",
    "Text",
    "Tokens",
    "check_choice",
    "check_int",
    "on_error_to_proto",
    "pipeline_or_default",
    "resolve_rank",
    "sampling_to_proto",
]

SAMPLING_MODES: Final[Mapping[str, loader_pb2.Sampling]] = {
    "uniform": loader_pb2.SAMPLING_UNIFORM,
    "weighted": loader_pb2.SAMPLING_WEIGHTED,
    "class_balanced": loader_pb2.SAMPLING_CLASS_BALANCED,
    "bucketed": loader_pb2.SAMPLING_BUCKETED,
}
ON_ERROR_POLICIES: Final[Mapping[str, loader_pb2.OnError]] = {
    name: loader_pb2.OnError.Value(f"ON_ERROR_{name.upper()}") for name in ON_ERROR_CHOICES
}
"""The wire's choices (``batchd._wire.specs``) as the proto's enum values, derived by name."""

_TOKEN_DTYPES: Final = {"int32": (-(1 << 31), (1 << 31) - 1), "uint16": (0, (1 << 16) - 1)}
# bool, signed, unsigned, float, complex: what a fixed-shape array field can hold.
_ARRAY_DTYPE_KINDS: Final = "biufc"


def sampling_to_proto(sampling: str) -> loader_pb2.Sampling:
    """The wire's ``Sampling`` value of ``sampling`` (InvalidArgument for an unknown one)."""
    return SAMPLING_MODES[check_choice("sampling", sampling, tuple(SAMPLING_MODES))]


def on_error_to_proto(on_error: str) -> loader_pb2.OnError:
    """The wire's ``OnError`` value of ``on_error`` (InvalidArgument for an unknown one)."""
    return ON_ERROR_POLICIES[check_choice("on_error", on_error, ON_ERROR_CHOICES)]


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(f"environment variable {name}={text!r} is not an integer") from None


def resolve_rank(
    rank: int | None, world_size: int | None, environ: Mapping[str, str] | None = None
) -> tuple[int, int]:
    """This process's (rank, world_size): given, else from ``torch.distributed`` when it is
    initialised, else ``$RANK`` / ``$WORLD_SIZE``, else 0 / 1.

    Raises:
        InvalidArgument: not integers, ``world_size < 1`` or ``rank`` outside
            ``[0, world_size)``; the message names where the values came from.
    """
    env = os.environ if environ is None else environ
    source = "arguments"
    if rank is None or world_size is None:
        # Only a process that imported torch.distributed can have initialised it: no need
        # to import torch (slow) to find out.
        dist: Any = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            found: tuple[int | None, int | None] = (dist.get_rank(), dist.get_world_size())
            source = "torch.distributed"
        else:
            found = (_env_int(env, "RANK"), _env_int(env, "WORLD_SIZE"))
            source = "the RANK / WORLD_SIZE environment"
        rank = found[0] if rank is None else rank
        world_size = found[1] if world_size is None else world_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{name}={value!r} (from {source}) must be an integer")
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgument(
            f"rank={rank}, world_size={world_size} (from {source}): need world_size >= 1 and "
            "0 <= rank < world_size"
        )
    return rank, world_size


def _range(name: str, value: object, *, upper: float) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in value)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise InvalidArgument(f"{name}={value!r} must be a pair (min, max) of numbers") from None
    if not (0 < low <= high <= upper and math.isfinite(high)):
        bound = f"<= {upper:g}" if math.isfinite(upper) else "finite"
        raise InvalidArgument(f"{name}={value!r} must satisfy 0 < min <= max, max {bound}")
    return low, high


@dataclass(frozen=True)
class Image:
    """Decode images (JPEG, PNG, WebP) to ``image``: uint8 ``[B, 3, size, size]``.

    Args:
        size: Output height and width, in pixels.
        resize: The shorter side is resized to this before a centre crop of ``size``, as
            torchvision's ``Resize(resize)`` + ``CenterCrop(size)`` do on a ``uint8`` tensor
            (antialiased bilinear); default ``size``. Ignored with ``random_crop``.
        random_crop: A random-resized crop (area fraction in ``scale``, aspect ratio in
            ``ratio``, as torchvision's ``RandomResizedCrop``) instead of resize + centre crop.
        flip: Flip horizontally with probability 1/2.
        decoder: ``"auto"`` (libjpeg-turbo through simplejpeg for JPEG where the server has
            it, else Pillow) or ``"pillow"``.
        scale: Area fraction range of ``random_crop``.
        ratio: Aspect ratio range of ``random_crop``.

    Randomness comes from (seed, epoch, sample id): the same whichever worker decodes it.
    """

    size: int = IMAGE_DEFAULT_SIZE
    resize: int | None = None
    random_crop: bool = False
    flip: bool = False
    decoder: str = "auto"
    scale: tuple[float, float] = IMAGE_DEFAULT_SCALE
    ratio: tuple[float, float] = IMAGE_DEFAULT_RATIO

    def __post_init__(self) -> None:
        size = check_int("Image size", self.size, 1, MAX_IMAGE_SIZE)
        if self.resize is not None:
            resize = check_int("Image resize", self.resize, size, MAX_IMAGE_SIZE)
            object.__setattr__(self, "resize", resize)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "random_crop", bool(self.random_crop))
        object.__setattr__(self, "flip", bool(self.flip))
        check_choice("Image decoder", self.decoder, IMAGE_DECODERS)
        object.__setattr__(self, "scale", _range("Image scale", self.scale, upper=1.0))
        object.__setattr__(self, "ratio", _range("Image ratio", self.ratio, upper=math.inf))

    def _to_proto(self) -> loader_pb2.Pipeline:
        return loader_pb2.Pipeline(
            image=loader_pb2.ImagePipeline(
                size=self.size,
                resize=self.resize or 0,
                random_crop=self.random_crop,
                flip=self.flip,
                decoder=self.decoder,
                scale_min=self.scale[0],
                scale_max=self.scale[1],
                ratio_min=self.ratio[0],
                ratio_max=self.ratio[1],
            )
        )


@dataclass(frozen=True)
class Array:
    """Fixed-shape arrays in ``array``: ``[B, *shape]`` of ``dtype``.

    Args:
        shape: One sample's shape (an int means a 1-d shape); ``()`` for scalars.
        dtype: A NumPy dtype (``"float32"``, ``np.int64``, ...); stored as its name.
        raw: The sample's bytes are the array itself, little-endian, C order; otherwise
            they are a ``.npy`` file (whole, or a blob inside a byte range of a shard).
    """

    shape: tuple[int, ...]
    dtype: str
    raw: bool = False

    def __post_init__(self) -> None:
        dims = (self.shape,) if isinstance(self.shape, int | np.integer) else self.shape
        try:
            shape = tuple(check_int("Array shape dimension", d, 1, 1 << 31) for d in dims)
        except TypeError:
            raise InvalidArgument(f"Array shape={self.shape!r} must be a tuple of ints") from None
        try:
            dtype = np.dtype(self.dtype)
        except TypeError as e:
            raise InvalidArgument(f"Array dtype={self.dtype!r} is not a NumPy dtype ({e})") from e
        if dtype.kind not in _ARRAY_DTYPE_KINDS or dtype.fields is not None:
            raise InvalidArgument(
                f"Array dtype={self.dtype!r} must be a numeric or bool dtype (float32, int64, ...)"
            )
        if dtype.byteorder == ">":
            raise InvalidArgument(
                f"Array dtype={self.dtype!r} is big-endian; give the plain dtype ({dtype.name}): "
                ".npy files carry their byte order and raw bytes are read as little-endian"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype.name)
        object.__setattr__(self, "raw", bool(self.raw))

    def _to_proto(self) -> loader_pb2.Pipeline:
        return loader_pb2.Pipeline(
            array=loader_pb2.ArrayPipeline(shape=self.shape, dtype=self.dtype, raw=self.raw)
        )


@dataclass(frozen=True)
class Tokens:
    """Token sequences in ``input_ids``, ``attention_mask`` and ``length``.

    Args:
        max_len: Longer sequences are truncated to this many tokens.
        dtype: How the token files are stored, ``"int32"`` or ``"uint16"``; ``input_ids``
            has this dtype.
        pad_id: Pads ``input_ids`` to the batch's longest sequence.

    ``input_ids`` and ``attention_mask`` (uint8) are ``[B, L]`` with ``L`` the batch's
    longest length (at most ``max_len``); ``length`` is int32 ``[B]``.
    """

    max_len: int
    dtype: str = "int32"
    pad_id: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "max_len", check_int("Tokens max_len", self.max_len, 1, MAX_TOKENS)
        )
        dtype = check_choice("Tokens dtype", self.dtype, tuple(_TOKEN_DTYPES))
        low, high = _TOKEN_DTYPES[dtype]
        object.__setattr__(
            self, "pad_id", check_int(f"Tokens pad_id ({dtype})", self.pad_id, low, high)
        )

    def _to_proto(self) -> loader_pb2.Pipeline:
        return loader_pb2.Pipeline(
            tokens=loader_pb2.TokensPipeline(
                max_len=self.max_len, dtype=self.dtype, pad_id=self.pad_id
            )
        )


def _tokenizer_path(what: str, path: object) -> str:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path.strip():
        raise InvalidArgument(
            f"{what} tokenizer={path!r} must be the path of a tokenizer.json on the server's "
            "machine (Hugging Face tokenizers' format; never fetched from a hub)"
        )
    return path


def _text_common(spec: Text | Chat) -> None:
    name = type(spec).__name__
    object.__setattr__(spec, "tokenizer", _tokenizer_path(name, spec.tokenizer))
    if spec.max_len is not None:
        object.__setattr__(
            spec, "max_len", check_int(f"{name} max_len", spec.max_len, 1, MAX_TOKENS)
        )
    dtype = check_choice(f"{name} dtype", spec.dtype, tuple(_TOKEN_DTYPES))
    low, high = _TOKEN_DTYPES[dtype]
    object.__setattr__(
        spec, "pad_id", check_int(f"{name} pad_id ({dtype})", spec.pad_id, low, high)
    )


@dataclass(frozen=True)
class Text:
    """Raw text tokenized on the server: the fields of :class:`Tokens` (``input_ids``,
    ``attention_mask``, ``length``), so :class:`batchd.Pack` and :class:`batchd.Mix` work
    on it as on token records.

    Args:
        tokenizer: A Hugging Face ``tokenizer.json`` on the server's machine; each decode
            worker loads it once and tokenizes a batch of documents at a time.
        add_bos: Put the tokenizer's beginning-of-sequence token before each document.
        add_eos: Put its end-of-sequence token after each document.
        max_len: Longer documents are truncated to this many tokens; None keeps whole
            documents, which only :class:`batchd.Pack` can serve (it cuts them into rows).
        dtype: ``"int32"`` or ``"uint16"`` (a vocabulary of at most 65536): ``input_ids``'
            dtype.
        pad_id: Pads ``input_ids``.

    Packing plans an epoch from each document's token count in the catalog: ingest the text
    with ``--tokenizer`` (the same file), see the text and chat data guide.
    """

    tokenizer: str
    add_bos: bool = True
    add_eos: bool = True
    max_len: int | None = None
    dtype: str = "int32"
    pad_id: int = 0

    def __post_init__(self) -> None:
        _text_common(self)
        object.__setattr__(self, "add_bos", bool(self.add_bos))
        object.__setattr__(self, "add_eos", bool(self.add_eos))

    def _to_proto(self) -> loader_pb2.Pipeline:
        return loader_pb2.Pipeline(
            text=loader_pb2.TextPipeline(
                tokenizer=self.tokenizer,
                add_bos=self.add_bos,
                add_eos=self.add_eos,
                max_len=self.max_len or 0,
                dtype=self.dtype,
                pad_id=self.pad_id,
            )
        )


@dataclass(frozen=True)
class Chat:
    """Chat transcripts (a list of ``{"role", "content"}`` messages) rendered with a chat
    template and tokenized on the server: the fields of :class:`Tokens` plus ``loss_mask``
    (uint8, 1 exactly on the tokens of assistant messages).

    Args:
        tokenizer: A Hugging Face ``tokenizer.json`` on the server's machine.
        template: A Jinja chat template (the text itself); None uses the ``chat_template``
            of the ``tokenizer_config.json`` beside the tokenizer.
        max_len: As :class:`Text`'s.
        dtype: As :class:`Text`'s.
        pad_id: As :class:`Text`'s.

    The template renders the special tokens (begin and end of turn) itself, so nothing is
    added around a conversation.
    """

    tokenizer: str
    template: str | None = None
    max_len: int | None = None
    dtype: str = "int32"
    pad_id: int = 0

    def __post_init__(self) -> None:
        _text_common(self)
        if self.template is not None and (
            not isinstance(self.template, str) or not self.template.strip()
        ):
            raise InvalidArgument(
                f"Chat template={self.template!r} must be a Jinja template's text, or None for "
                "the tokenizer's own chat_template"
            )

    def _to_proto(self) -> loader_pb2.Pipeline:
        return loader_pb2.Pipeline(
            text=loader_pb2.TextPipeline(
                tokenizer=self.tokenizer,
                max_len=self.max_len or 0,
                dtype=self.dtype,
                pad_id=self.pad_id,
                chat=True,
                template=self.template or "",
            )
        )


@dataclass(frozen=True, init=False)
class Custom:
    """A decoder registered on the server by name (entry-point group ``batchd.decoders``).

    Args:
        name: The entry point's name.
        **options: Keyword arguments for the decoder's factory; they travel as JSON, so
            they must be JSON values (str, int, float, bool, None, lists, dicts).
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __init__(self, name: str, **options: Any) -> None:
        if not isinstance(name, str) or not name.strip():
            raise InvalidArgument(f"Custom name={name!r} must be a decoder's registered name")
        try:
            # Round-trip so the stored options are exactly what the server will see.
            canonical = json.loads(json.dumps(options, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise InvalidArgument(
                f"Custom({name!r}) options must be JSON values (str, int, float, bool, None, "
                f"lists, dicts): {e}"
            ) from e
        object.__setattr__(self, "name", name.strip())
        object.__setattr__(self, "options", canonical)

    def _to_proto(self) -> loader_pb2.Pipeline:
        return loader_pb2.Pipeline(
            custom=loader_pb2.CustomPipeline(
                name=self.name, options_json=json.dumps(self.options, sort_keys=True)
            )
        )


PipelineSpec: TypeAlias = Image | Array | Tokens | Text | Chat | Custom | Video | Audio
"""Any pipeline spec a :class:`batchd.Loader` accepts."""


def pipeline_or_default(pipeline: object) -> PipelineSpec:
    """``pipeline``, or ``Image()`` for None; InvalidArgument for anything that is not a spec."""
    if pipeline is None:
        return Image()
    if not isinstance(pipeline, Image | Array | Tokens | Text | Chat | Custom | Video | Audio):
        raise InvalidArgument(
            f"pipeline={pipeline!r} is not a pipeline spec; pass batchd.Image(...), "
            "batchd.Array(...), batchd.Tokens(...), batchd.Text(...), batchd.Chat(...), "
            "batchd.Video(...), batchd.Audio(...) or batchd.Custom(...)"
        )
    return pipeline

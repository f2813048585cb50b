"""The session RPCs: OpenSession, StreamBatches, CloseSession. Thin: parse, call, reply."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Final, NamedTuple

import grpc

from batchd._proto.batchd.v1 import loader_pb2 as pb
from batchd._wire.schedule import WeightSchedule
from batchd._wire.specs import IMAGE_DEFAULT_RATIO, IMAGE_DEFAULT_SCALE
from batchd_server.api.admission import client_identity
from batchd_server.delivery.messages import inline_messages, ring_layout, start_stream
from batchd_server.errors import FailedPrecondition, InvalidArgument
from batchd_server.limits import check_name
from batchd_server.logs import session_log_id
from batchd_server.metrics import stall
from batchd_server.planning.mixing import MixOptions, MixSourceOptions
from batchd_server.planning.packing import PackOptions
from batchd_server.planning.sampling import SamplerOptions
from batchd_server.sessions import Session, SessionManager, SessionOptions, Stream
from batchd_server.sessions.sources import snapshot_token

__all__ = ["open_session", "session_options", "stream_batches"]

logger = logging.getLogger(__name__)


_HALF_CLOSE_WAIT_S: Final = 5.0
"""How long an inline stream whose batches are all sent waits for the client's last acks."""
_POLL_S: Final = 0.1

_SAMPLING = {
    pb.SAMPLING_UNSPECIFIED: "uniform",
    pb.SAMPLING_UNIFORM: "uniform",
    pb.SAMPLING_WEIGHTED: "weighted",
    pb.SAMPLING_CLASS_BALANCED: "class_balanced",
    pb.SAMPLING_BUCKETED: "bucketed",
}
_ON_ERROR = {
    pb.ON_ERROR_UNSPECIFIED: "skip",
    pb.ON_ERROR_SKIP: "skip",
    pb.ON_ERROR_RAISE: "raise",
    pb.ON_ERROR_REPLACE: "replace",
}


def _pipeline(spec: pb.Pipeline) -> tuple[str, dict[str, Any]]:
    kind = spec.WhichOneof("kind")
    if kind == "image":
        image = spec.image
        options: dict[str, Any] = {"size": image.size, "resize": image.resize}
        options.update(random_crop=image.random_crop, flip=image.flip)
        options["decoder"] = image.decoder or "auto"
        if image.scale_min or image.scale_max:
            options["scale"] = (
                image.scale_min or IMAGE_DEFAULT_SCALE[0],
                image.scale_max or IMAGE_DEFAULT_SCALE[1],
            )
        if image.ratio_min or image.ratio_max:
            options["ratio"] = (
                image.ratio_min or IMAGE_DEFAULT_RATIO[0],
                image.ratio_max or IMAGE_DEFAULT_RATIO[1],
            )
        return "image", options
    if kind == "array":
        array = spec.array
        return "array", {"shape": tuple(array.shape), "dtype": array.dtype, "raw": array.raw}
    if kind == "tokens":
        tokens = spec.tokens
        dtype = tokens.dtype or "int32"
        return "tokens", {"max_len": tokens.max_len, "dtype": dtype, "pad_id": tokens.pad_id}
    if kind == "text":
        text = spec.text
        options = {"tokenizer": text.tokenizer, "max_len": text.max_len or None}
        options.update(dtype=text.dtype or "int32", pad_id=text.pad_id)
        if text.chat:
            return "chat", {**options, "template": text.template or None}
        return "text", {**options, "add_bos": text.add_bos, "add_eos": text.add_eos}
    if kind == "video":
        video = spec.video
        options = {"frames": video.frames or 16, "size": video.size or 224, "fps": video.fps}
        options.update(clip=video.clip or "random", clips_per_video=video.clips_per_video or 1)
        return "video", options
    if kind == "audio":
        audio = spec.audio
        options = {"sample_rate": audio.sample_rate or 16000, "seconds": audio.seconds or None}
        options.update(mono=not audio.stereo, crop=audio.crop or "random")
        options.update(dtype=audio.dtype or "float32", max_seconds=audio.max_seconds or 30.0)
        return "audio", options
    if kind == "custom":
        try:
            custom_options = json.loads(spec.custom.options_json or "{}")
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"custom pipeline options are not valid JSON: {e}") from e
        if not isinstance(custom_options, dict):
            raise InvalidArgument("custom pipeline options must be a JSON object")
        return "custom", {"name": spec.custom.name, "options": custom_options}
    if kind == "fields":
        fields = []
        for f in spec.fields.fields:
            if f.pipeline.WhichOneof("kind") == "fields":
                raise InvalidArgument(f"field {f.name!r}: a field's pipeline cannot be fields")
            inner_kind, inner = _pipeline(f.pipeline)
            fields.append(
                {
                    "name": f.name,
                    "source": f.source,
                    "optional": f.optional,
                    "kind": inner_kind,
                    "options": inner,
                }
            )
        return "fields", {"fields": fields}
    raise InvalidArgument(
        "OpenSession needs a pipeline: image, array, tokens, text, video, audio, custom or "
        "fields "
        "(batchd.Image(), batchd.Array(...), batchd.Tokens(...), batchd.Text(...), "
        "batchd.Chat(...), batchd.Video(...), batchd.Audio(...), batchd.Custom(...))"
    )


def session_options(request: pb.OpenSessionRequest) -> SessionOptions:
    """The request as validated domain options."""
    if request.sampling not in _SAMPLING:
        raise InvalidArgument(f"sampling={request.sampling} is not a known Sampling value")
    if request.on_error not in _ON_ERROR:
        raise InvalidArgument(f"on_error={request.on_error} is not a known OnError value")
    sampler = SamplerOptions(
        batch_size=request.batch_size,
        shuffle=request.shuffle,
        seed=request.seed,
        rank=request.rank,
        world_size=request.world_size or 1,
        drop_last=request.drop_last,
        mode=_SAMPLING[request.sampling],
    )
    kind, options = _pipeline(request.pipeline)
    target = _mix_target(request, sampler) if request.HasField("mix") else _split_target(request)
    return SessionOptions(
        dataset=target.dataset,
        version=target.version,
        split=target.split,
        sampler=sampler,
        pipeline_kind=kind,
        pipeline_options=options,
        prefetch=request.prefetch or 4,
        snapshot=request.snapshot or None,
        on_error=_ON_ERROR[request.on_error],
        max_error_fraction=request.max_error_fraction or 0.01,
        mix=target.mix,
        decode_cache=not request.no_decode_cache,
        pack=_pack(request),
        share=request.share,
    )


_PACK_METHODS: Final = {
    pb.PACK_METHOD_UNSPECIFIED: "best_fit",
    pb.PACK_METHOD_BEST_FIT: "best_fit",
    pb.PACK_METHOD_FIRST_FIT: "first_fit",
    pb.PACK_METHOD_CONCAT: "concat",
}


def _pack(request: pb.OpenSessionRequest) -> PackOptions | None:
    """``request.pack`` as validated options; None when the request packs nothing."""
    if not request.HasField("pack"):
        return None
    method = _PACK_METHODS.get(request.pack.method)
    if method is None:
        raise InvalidArgument(f"pack method={request.pack.method} is not a known PackMethod")
    return PackOptions(seq_len=request.pack.seq_len, method=method)


class _Target(NamedTuple):
    """What a session serves."""

    dataset: str
    """The dataset's name, or a mix's label."""
    version: str | None
    split: str
    mix: MixOptions | None


def _split_target(request: pb.OpenSessionRequest) -> _Target:
    """``request``'s dataset, version and split, checked."""
    check_name("dataset", request.dataset)
    check_name("version", request.version, required=False)
    check_name("split", request.split, required=False)
    return _Target(request.dataset, request.version or None, request.split or "train", None)


def _mix_target(request: pb.OpenSessionRequest, sampler: SamplerOptions) -> _Target:
    """``request.mix`` as validated options, under its label."""
    if request.dataset or request.version or request.split:
        raise InvalidArgument(
            "OpenSession got a mix and a dataset, version or split besides; a mixed session "
            "names its splits in the mix's sources only"
        )
    sources = []
    for source in request.mix.sources:
        check_name("dataset", source.dataset)
        check_name("version", source.version, required=False)
        check_name("split", source.split, required=False)
        kind, options = _pipeline(source.pipeline) if source.HasField("pipeline") else (None, {})
        sources.append(
            MixSourceOptions(
                dataset=source.dataset,
                version=source.version or None,
                split=source.split or "train",
                weight=source.weight,
                pipeline_kind=kind,
                pipeline_options=options,
            )
        )
    mix = MixOptions(
        sources=tuple(sources),
        stop_samples=request.mix.stop_samples,
        schedule=_schedule(request.mix, tuple(s.weight for s in sources)),
    )
    if sampler.mode != "uniform":
        raise InvalidArgument(
            f"sampling={sampler.mode!r} cannot be used with a mix: the mix's weights decide how "
            "samples are drawn; use sampling 'uniform'"
        )
    return _Target(mix.label, None, "", mix)


def _schedule(mix: pb.Mix, base: tuple[float, ...]) -> WeightSchedule | None:
    """``mix.schedule`` as a validated schedule over ``base``; None without points."""
    if not mix.schedule:
        if mix.interpolate:
            raise InvalidArgument(
                f"the mix has interpolate={mix.interpolate!r} but no schedule; give schedule "
                "points, or leave interpolate empty"
            )
        return None
    points = tuple((int(p.step), tuple(p.weights)) for p in mix.schedule)
    return WeightSchedule(base, points, mix.interpolate or "step")


def open_session(
    sessions: SessionManager, request: pb.OpenSessionRequest, client: str = ""
) -> pb.OpenSessionResponse:
    """Open the session ``request`` asks for, on behalf of ``client`` (its quotas)."""
    options = session_options(request)
    session = sessions.open(options, client)
    version, sources = _served(session)
    mix_schedule = None if options.mix is None else options.mix.schedule
    return pb.OpenSessionResponse(
        session_id=session.id,
        num_batches=session.num_batches,
        num_samples=session.num_samples,
        num_rows=session.num_rows,
        fields=[pb.FieldSchema(name=f.name, dtype=f.dtype, shape=f.shape) for f in session.layout],
        snapshot=snapshot_token(options, session.catalogs),
        ring=ring_layout(session.ring_ref, sessions.doorbell),
        lease_timeout_s=sessions.lease_timeout_s,
        version=version,
        split=options.split,
        prefetch=options.prefetch,
        sources=sources,
        schedule_points=0 if mix_schedule is None else len(mix_schedule.points),
        rotations=True,
    )


def _served(session: Session) -> tuple[str, list[pb.MixSource]]:
    """The reply's ``version`` and ``sources``: a split's version and no sources, or, for a
    mix (whose sources each have a version), "" and every source as the server resolved it."""
    mix = session.options.mix
    if mix is None:
        return session.catalogs[0].arrays.dataset.version, []
    return "", [
        pb.MixSource(
            dataset=source.dataset,
            version=entry.arrays.dataset.version,
            split=source.split,
            weight=source.weight,
            rows=rows,
            epoch_samples=samples,
        )
        for source, entry, rows, samples in zip(
            mix.sources, session.catalogs, session.source_rows, session.source_samples, strict=True
        )
    ]


def _read_acks(
    requests: Iterator[pb.StreamBatchesRequest], session: Session, stream: Stream
) -> None:
    """Apply the client's acks until it half-closes or the call ends."""
    try:
        for request in requests:
            if request.WhichOneof("kind") != "ack":
                logger.warning(
                    "session %s: ignoring a second StreamStart", session_log_id(session.id)
                )
                continue
            session.ack(stream, list(request.ack.batch_indices))
            stall.record_client_timings(
                session.options.dataset,
                request.ack.batch_wait_s,
                request.ack.batch_step_s,
                now=time.monotonic(),
                client=session.client,
                allowance=session.timings,
            )
    except grpc.RpcError:  # the call ended (cancelled, client gone): nothing to read any more
        pass
    except Exception as e:  # a server bug: this stream's acks are no longer applied
        logger.warning(
            "session %s: stopped applying the acks of its inline stream (%s: %s)",
            session_log_id(session.id),
            type(e).__name__,
            e,
            exc_info=True,
        )


def stream_batches(
    sessions: SessionManager,
    requests: Iterator[pb.StreamBatchesRequest],
    context: grpc.ServicerContext,
) -> Iterator[pb.StreamBatchesResponse]:
    try:
        first = next(requests, None)
    except grpc.RpcError:  # cancelled, or the client went away, before its first message
        return
    if first is None or first.WhichOneof("kind") != "start":
        raise InvalidArgument("StreamBatches must begin with a StreamStart message")
    start = first.start
    session = sessions.get(start.session_id, client_identity(context))
    if start.transport == pb.TRANSPORT_SHM:
        raise FailedPrecondition(
            "shm streams run on the session's doorbell (RingLayout.doorbell), not as a "
            "StreamBatches call; send the StreamStart there, or use TRANSPORT_INLINE"
        )
    stream = start_stream(session, start, shm=False)
    # The callback runs however the call ends, even while this generator is suspended in a
    # yield that grpc will never resume (a client killed mid-epoch).
    context.add_callback(lambda: session.end_stream(stream))
    reader = threading.Thread(
        target=_read_acks, args=(requests, session, stream), name="batchd-acks", daemon=True
    )
    reader.start()
    try:
        if start.accept_first:  # the client bounds its wait for this, not for a batch
            yield pb.StreamBatchesResponse(accepted=True, slot=-1)
        for ready in session.batches(stream, context.is_active):
            yield from inline_messages(session, ready)
        # The client's last acks (with the loop's timings of the last batches) are still on
        # their way when the last batch goes out; ending the call now would drop them. The
        # client half-closes once it has the whole epoch, which ends the reader.
        deadline = time.monotonic() + _HALF_CLOSE_WAIT_S
        while reader.is_alive() and context.is_active() and time.monotonic() < deadline:
            reader.join(_POLL_S)
    finally:
        session.end_stream(stream)

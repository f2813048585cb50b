import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLING_UNSPECIFIED: _ClassVar[Sampling]
    SAMPLING_UNIFORM: _ClassVar[Sampling]
    SAMPLING_WEIGHTED: _ClassVar[Sampling]
    SAMPLING_CLASS_BALANCED: _ClassVar[Sampling]
    SAMPLING_BUCKETED: _ClassVar[Sampling]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_INLINE: _ClassVar[Transport]

class OnError(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ON_ERROR_UNSPECIFIED: _ClassVar[OnError]
    ON_ERROR_SKIP: _ClassVar[OnError]
    ON_ERROR_RAISE: _ClassVar[OnError]
    ON_ERROR_REPLACE: _ClassVar[OnError]

class PackMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PACK_METHOD_UNSPECIFIED: _ClassVar[PackMethod]
    PACK_METHOD_BEST_FIT: _ClassVar[PackMethod]
    PACK_METHOD_FIRST_FIT: _ClassVar[PackMethod]
    PACK_METHOD_CONCAT: _ClassVar[PackMethod]
SAMPLING_UNSPECIFIED: Sampling
SAMPLING_UNIFORM: Sampling
SAMPLING_WEIGHTED: Sampling
SAMPLING_CLASS_BALANCED: Sampling
SAMPLING_BUCKETED: Sampling
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_SHM: Transport
TRANSPORT_INLINE: Transport
ON_ERROR_UNSPECIFIED: OnError
ON_ERROR_SKIP: OnError
ON_ERROR_RAISE: OnError
ON_ERROR_REPLACE: OnError
PACK_METHOD_UNSPECIFIED: PackMethod
PACK_METHOD_BEST_FIT: PackMethod
PACK_METHOD_FIRST_FIT: PackMethod
PACK_METHOD_CONCAT: PackMethod

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[Dataset]
    def __init__(self, datasets: _Optional[_Iterable[_Union[Dataset, _Mapping]]] = ...) -> None: ...

class DescribeDatasetRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class DescribeDatasetResponse(_message.Message):
    __slots__ = ("dataset",)
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: Dataset
    def __init__(self, dataset: _Optional[_Union[Dataset, _Mapping]] = ...) -> None: ...

class Dataset(_message.Message):
    __slots__ = ("name", "version", "root", "description", "created_at", "classes", "splits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    root: str
    description: str
    created_at: _timestamp_pb2.Timestamp
    classes: _containers.RepeatedScalarFieldContainer[str]
    splits: _containers.RepeatedCompositeFieldContainer[Split]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., root: _Optional[str] = ..., description: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., classes: _Optional[_Iterable[str]] = ..., splits: _Optional[_Iterable[_Union[Split, _Mapping]]] = ...) -> None: ...

class Split(_message.Message):
    __slots__ = ("name", "samples", "verified")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    name: str
    samples: int
    verified: int
    def __init__(self, name: _Optional[str] = ..., samples: _Optional[int] = ..., verified: _Optional[int] = ...) -> None: ...

class ImagePipeline(_message.Message):
    __slots__ = ("size", "resize", "random_crop", "flip", "decoder", "scale_min", "scale_max", "ratio_min", "ratio_max")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    RANDOM_CROP_FIELD_NUMBER: _ClassVar[int]
    FLIP_FIELD_NUMBER: _ClassVar[int]
    DECODER_FIELD_NUMBER: _ClassVar[int]
    SCALE_MIN_FIELD_NUMBER: _ClassVar[int]
    SCALE_MAX_FIELD_NUMBER: _ClassVar[int]
    RATIO_MIN_FIELD_NUMBER: _ClassVar[int]
    RATIO_MAX_FIELD_NUMBER: _ClassVar[int]
    size: int
    resize: int
    random_crop: bool
    flip: bool
    decoder: str
    scale_min: float
    scale_max: float
    ratio_min: float
    ratio_max: float
    def __init__(self, size: _Optional[int] = ..., resize: _Optional[int] = ..., random_crop: _Optional[bool] = ..., flip: _Optional[bool] = ..., decoder: _Optional[str] = ..., scale_min: _Optional[float] = ..., scale_max: _Optional[float] = ..., ratio_min: _Optional[float] = ..., ratio_max: _Optional[float] = ...) -> None: ...

class ArrayPipeline(_message.Message):
    __slots__ = ("shape", "dtype", "raw")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    raw: bool
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., raw: _Optional[bool] = ...) -> None: ...

class TokensPipeline(_message.Message):
    __slots__ = ("max_len", "dtype", "pad_id")
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAD_ID_FIELD_NUMBER: _ClassVar[int]
    max_len: int
    dtype: str
    pad_id: int
    def __init__(self, max_len: _Optional[int] = ..., dtype: _Optional[str] = ..., pad_id: _Optional[int] = ...) -> None: ...

class TextPipeline(_message.Message):
    __slots__ = ("tokenizer", "add_bos", "add_eos", "max_len", "dtype", "pad_id", "chat", "template")
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    ADD_EOS_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAD_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    tokenizer: str
    add_bos: bool
    add_eos: bool
    max_len: int
    dtype: str
    pad_id: int
    chat: bool
    template: str
    def __init__(self, tokenizer: _Optional[str] = ..., add_bos: _Optional[bool] = ..., add_eos: _Optional[bool] = ..., max_len: _Optional[int] = ..., dtype: _Optional[str] = ..., pad_id: _Optional[int] = ..., chat: _Optional[bool] = ..., template: _Optional[str] = ...) -> None: ...

class CustomPipeline(_message.Message):
    __slots__ = ("name", "options_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    options_json: str
    def __init__(self, name: _Optional[str] = ..., options_json: _Optional[str] = ...) -> None: ...

class VideoPipeline(_message.Message):
    __slots__ = ("frames", "size", "fps", "clip", "clips_per_video")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    CLIPS_PER_VIDEO_FIELD_NUMBER: _ClassVar[int]
    frames: int
    size: int
    fps: float
    clip: str
    clips_per_video: int
    def __init__(self, frames: _Optional[int] = ..., size: _Optional[int] = ..., fps: _Optional[float] = ..., clip: _Optional[str] = ..., clips_per_video: _Optional[int] = ...) -> None: ...

class AudioPipeline(_message.Message):
    __slots__ = ("sample_rate", "seconds", "stereo", "crop", "dtype", "max_seconds")
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEREO_FIELD_NUMBER: _ClassVar[int]
    CROP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sample_rate: int
    seconds: float
    stereo: bool
    crop: str
    dtype: str
    max_seconds: float
    def __init__(self, sample_rate: _Optional[int] = ..., seconds: _Optional[float] = ..., stereo: _Optional[bool] = ..., crop: _Optional[str] = ..., dtype: _Optional[str] = ..., max_seconds: _Optional[float] = ...) -> None: ...

class Pipeline(_message.Message):
    __slots__ = ("image", "array", "tokens", "custom", "text", "fields", "video", "audio")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    image: ImagePipeline
    array: ArrayPipeline
    tokens: TokensPipeline
    custom: CustomPipeline
    text: TextPipeline
    fields: FieldsPipeline
    video: VideoPipeline
    audio: AudioPipeline
    def __init__(self, image: _Optional[_Union[ImagePipeline, _Mapping]] = ..., array: _Optional[_Union[ArrayPipeline, _Mapping]] = ..., tokens: _Optional[_Union[TokensPipeline, _Mapping]] = ..., custom: _Optional[_Union[CustomPipeline, _Mapping]] = ..., text: _Optional[_Union[TextPipeline, _Mapping]] = ..., fields: _Optional[_Union[FieldsPipeline, _Mapping]] = ..., video: _Optional[_Union[VideoPipeline, _Mapping]] = ..., audio: _Optional[_Union[AudioPipeline, _Mapping]] = ...) -> None: ...

class SampleField(_message.Message):
    __slots__ = ("name", "source", "optional", "pipeline")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    OPTIONAL_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    optional: bool
    pipeline: Pipeline
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., optional: _Optional[bool] = ..., pipeline: _Optional[_Union[Pipeline, _Mapping]] = ...) -> None: ...

class FieldsPipeline(_message.Message):
    __slots__ = ("fields",)
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    fields: _containers.RepeatedCompositeFieldContainer[SampleField]
    def __init__(self, fields: _Optional[_Iterable[_Union[SampleField, _Mapping]]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("dataset", "version", "split", "batch_size", "shuffle", "seed", "rank", "world_size", "drop_last", "sampling", "pipeline", "prefetch", "snapshot", "on_error", "max_error_fraction", "mix", "no_decode_cache", "pack", "share")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ON_ERROR_FIELD_NUMBER: _ClassVar[int]
    MAX_ERROR_FRACTION_FIELD_NUMBER: _ClassVar[int]
    MIX_FIELD_NUMBER: _ClassVar[int]
    NO_DECODE_CACHE_FIELD_NUMBER: _ClassVar[int]
    PACK_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    version: str
    split: str
    batch_size: int
    shuffle: bool
    seed: int
    rank: int
    world_size: int
    drop_last: bool
    sampling: Sampling
    pipeline: Pipeline
    prefetch: int
    snapshot: str
    on_error: OnError
    max_error_fraction: float
    mix: Mix
    no_decode_cache: bool
    pack: Pack
    share: str
    def __init__(self, dataset: _Optional[str] = ..., version: _Optional[str] = ..., split: _Optional[str] = ..., batch_size: _Optional[int] = ..., shuffle: _Optional[bool] = ..., seed: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., drop_last: _Optional[bool] = ..., sampling: _Optional[_Union[Sampling, str]] = ..., pipeline: _Optional[_Union[Pipeline, _Mapping]] = ..., prefetch: _Optional[int] = ..., snapshot: _Optional[str] = ..., on_error: _Optional[_Union[OnError, str]] = ..., max_error_fraction: _Optional[float] = ..., mix: _Optional[_Union[Mix, _Mapping]] = ..., no_decode_cache: _Optional[bool] = ..., pack: _Optional[_Union[Pack, _Mapping]] = ..., share: _Optional[str] = ...) -> None: ...

class Pack(_message.Message):
    __slots__ = ("seq_len", "method")
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    seq_len: int
    method: PackMethod
    def __init__(self, seq_len: _Optional[int] = ..., method: _Optional[_Union[PackMethod, str]] = ...) -> None: ...

class MixSource(_message.Message):
    __slots__ = ("dataset", "version", "split", "weight", "rows", "epoch_samples", "pipeline")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    version: str
    split: str
    weight: float
    rows: int
    epoch_samples: int
    pipeline: Pipeline
    def __init__(self, dataset: _Optional[str] = ..., version: _Optional[str] = ..., split: _Optional[str] = ..., weight: _Optional[float] = ..., rows: _Optional[int] = ..., epoch_samples: _Optional[int] = ..., pipeline: _Optional[_Union[Pipeline, _Mapping]] = ...) -> None: ...

class Mix(_message.Message):
    __slots__ = ("sources", "stop_samples", "schedule", "interpolate")
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    STOP_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    INTERPOLATE_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[MixSource]
    stop_samples: int
    schedule: _containers.RepeatedCompositeFieldContainer[MixSchedulePoint]
    interpolate: str
    def __init__(self, sources: _Optional[_Iterable[_Union[MixSource, _Mapping]]] = ..., stop_samples: _Optional[int] = ..., schedule: _Optional[_Iterable[_Union[MixSchedulePoint, _Mapping]]] = ..., interpolate: _Optional[str] = ...) -> None: ...

class MixSchedulePoint(_message.Message):
    __slots__ = ("step", "weights")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, step: _Optional[int] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class FieldSchema(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class RingLayout(_message.Message):
    __slots__ = ("shm_name", "segment_bytes", "header_bytes", "slot_bytes", "slots", "token", "doorbell")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEADER_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    segment_bytes: int
    header_bytes: int
    slot_bytes: int
    slots: int
    token: bytes
    doorbell: str
    def __init__(self, shm_name: _Optional[str] = ..., segment_bytes: _Optional[int] = ..., header_bytes: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., slots: _Optional[int] = ..., token: _Optional[bytes] = ..., doorbell: _Optional[str] = ...) -> None: ...

class DoorbellHello(_message.Message):
    __slots__ = ("session_id", "token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token: bytes
    def __init__(self, session_id: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "num_batches", "num_samples", "fields", "snapshot", "ring", "lease_timeout_s", "version", "split", "prefetch", "num_rows", "sources", "schedule_points", "rotations")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_POINTS_FIELD_NUMBER: _ClassVar[int]
    ROTATIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_batches: int
    num_samples: int
    fields: _containers.RepeatedCompositeFieldContainer[FieldSchema]
    snapshot: str
    ring: RingLayout
    lease_timeout_s: float
    version: str
    split: str
    prefetch: int
    num_rows: int
    sources: _containers.RepeatedCompositeFieldContainer[MixSource]
    schedule_points: int
    rotations: bool
    def __init__(self, session_id: _Optional[str] = ..., num_batches: _Optional[int] = ..., num_samples: _Optional[int] = ..., fields: _Optional[_Iterable[_Union[FieldSchema, _Mapping]]] = ..., snapshot: _Optional[str] = ..., ring: _Optional[_Union[RingLayout, _Mapping]] = ..., lease_timeout_s: _Optional[float] = ..., version: _Optional[str] = ..., split: _Optional[str] = ..., prefetch: _Optional[int] = ..., num_rows: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[MixSource, _Mapping]]] = ..., schedule_points: _Optional[int] = ..., rotations: _Optional[bool] = ...) -> None: ...

class StreamStart(_message.Message):
    __slots__ = ("session_id", "epoch", "start_batch", "transport", "seq", "held_leases", "start_sample", "order_world_size", "stride", "heartbeat", "accept_first", "rotation", "join_share", "read_shared")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_BATCH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HELD_LEASES_FIELD_NUMBER: _ClassVar[int]
    START_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    ORDER_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIRST_FIELD_NUMBER: _ClassVar[int]
    ROTATION_FIELD_NUMBER: _ClassVar[int]
    JOIN_SHARE_FIELD_NUMBER: _ClassVar[int]
    READ_SHARED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    start_batch: int
    transport: Transport
    seq: int
    held_leases: _containers.RepeatedScalarFieldContainer[int]
    start_sample: int
    order_world_size: int
    stride: int
    heartbeat: bool
    accept_first: bool
    rotation: int
    join_share: bool
    read_shared: bool
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., start_batch: _Optional[int] = ..., transport: _Optional[_Union[Transport, str]] = ..., seq: _Optional[int] = ..., held_leases: _Optional[_Iterable[int]] = ..., start_sample: _Optional[int] = ..., order_world_size: _Optional[int] = ..., stride: _Optional[int] = ..., heartbeat: _Optional[bool] = ..., accept_first: _Optional[bool] = ..., rotation: _Optional[int] = ..., join_share: _Optional[bool] = ..., read_shared: _Optional[bool] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("batch_indices", "wait_s", "leases", "batch_wait_s", "batch_step_s")
    BATCH_INDICES_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    BATCH_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_STEP_S_FIELD_NUMBER: _ClassVar[int]
    batch_indices: _containers.RepeatedScalarFieldContainer[int]
    wait_s: float
    leases: _containers.RepeatedScalarFieldContainer[int]
    batch_wait_s: _containers.RepeatedScalarFieldContainer[float]
    batch_step_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, batch_indices: _Optional[_Iterable[int]] = ..., wait_s: _Optional[float] = ..., leases: _Optional[_Iterable[int]] = ..., batch_wait_s: _Optional[_Iterable[float]] = ..., batch_step_s: _Optional[_Iterable[float]] = ...) -> None: ...

class StreamBatchesRequest(_message.Message):
    __slots__ = ("start", "ack")
    START_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    start: StreamStart
    ack: Ack
    def __init__(self, start: _Optional[_Union[StreamStart, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ...) -> None: ...

class FieldView(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class StreamBatchesResponse(_message.Message):
    __slots__ = ("batch_index", "slot", "rows", "fields", "failed_sample_ids", "data", "more", "inline_bytes", "lease", "seq", "accepted", "ring")
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    INLINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    batch_index: int
    slot: int
    rows: int
    fields: _containers.RepeatedCompositeFieldContainer[FieldView]
    failed_sample_ids: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    more: bool
    inline_bytes: int
    lease: int
    seq: int
    accepted: bool
    ring: RingLayout
    def __init__(self, batch_index: _Optional[int] = ..., slot: _Optional[int] = ..., rows: _Optional[int] = ..., fields: _Optional[_Iterable[_Union[FieldView, _Mapping]]] = ..., failed_sample_ids: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., more: _Optional[bool] = ..., inline_bytes: _Optional[int] = ..., lease: _Optional[int] = ..., seq: _Optional[int] = ..., accepted: _Optional[bool] = ..., ring: _Optional[_Union[RingLayout, _Mapping]] = ...) -> None: ...

class DoorbellEnd(_message.Message):
    __slots__ = ("seq", "error_class", "message")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    error_class: str
    message: str
    def __init__(self, seq: _Optional[int] = ..., error_class: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class DoorbellHeartbeat(_message.Message):
    __slots__ = ("interval_s",)
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    def __init__(self, interval_s: _Optional[float] = ...) -> None: ...

class DoorbellCancel(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

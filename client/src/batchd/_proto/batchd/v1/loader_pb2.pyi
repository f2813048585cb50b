import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    DATA_TYPE_FP32: _ClassVar[DataType]
    DATA_TYPE_FP64: _ClassVar[DataType]
    DATA_TYPE_FP16: _ClassVar[DataType]
    DATA_TYPE_INT64: _ClassVar[DataType]
DATA_TYPE_UNSPECIFIED: DataType
DATA_TYPE_FP32: DataType
DATA_TYPE_FP64: DataType
DATA_TYPE_FP16: DataType
DATA_TYPE_INT64: DataType

class Tensor(_message.Message):
    __slots__ = ("data_type", "shape", "content")
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    data_type: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    content: bytes
    def __init__(self, data_type: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., content: _Optional[bytes] = ...) -> None: ...

class InferRequest(_message.Message):
    __slots__ = ("model_name", "model_version", "inputs", "per_row_errors", "priority")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    PER_ROW_ERRORS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    inputs: Tensor
    per_row_errors: bool
    priority: int
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., inputs: _Optional[_Union[Tensor, _Mapping]] = ..., per_row_errors: bool = ..., priority: _Optional[int] = ...) -> None: ...

class RowError(_message.Message):
    __slots__ = ("row", "reason", "message")
    ROW_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    row: int
    reason: str
    message: str
    def __init__(self, row: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("model_name", "model_version", "logits", "row_errors")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    ROW_ERRORS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    logits: Tensor
    row_errors: _containers.RepeatedCompositeFieldContainer[RowError]
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., logits: _Optional[_Union[Tensor, _Mapping]] = ..., row_errors: _Optional[_Iterable[_Union[RowError, _Mapping]]] = ...) -> None: ...

class ModelMetadataRequest(_message.Message):
    __slots__ = ("model_name", "model_version")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "data_type", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    data_type: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., data_type: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class VersionTriple(_message.Message):
    __slots__ = ("model_version", "feature_schema_version", "preprocessing_hash")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREPROCESSING_HASH_FIELD_NUMBER: _ClassVar[int]
    model_version: str
    feature_schema_version: str
    preprocessing_hash: str
    def __init__(self, model_version: _Optional[str] = ..., feature_schema_version: _Optional[str] = ..., preprocessing_hash: _Optional[str] = ...) -> None: ...

class ModelMetadataResponse(_message.Message):
    __slots__ = ("model_name", "model_version", "available_versions", "inputs", "outputs", "versions", "runtime")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    available_versions: _containers.RepeatedScalarFieldContainer[str]
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    versions: VersionTriple
    runtime: str
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., available_versions: _Optional[_Iterable[str]] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., versions: _Optional[_Union[VersionTriple, _Mapping]] = ..., runtime: _Optional[str] = ...) -> None: ...

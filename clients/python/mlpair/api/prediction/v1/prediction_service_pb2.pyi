from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Decision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_UNSPECIFIED: _ClassVar[Decision]
    DECISION_APPROVE: _ClassVar[Decision]
    DECISION_REVIEW: _ClassVar[Decision]
    DECISION_DECLINE: _ClassVar[Decision]
DECISION_UNSPECIFIED: Decision
DECISION_APPROVE: Decision
DECISION_REVIEW: Decision
DECISION_DECLINE: Decision

class AttributeValue(_message.Message):
    __slots__ = ("number_value", "string_value", "bool_value")
    NUMBER_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    number_value: float
    string_value: str
    bool_value: bool
    def __init__(self, number_value: _Optional[float] = ..., string_value: _Optional[str] = ..., bool_value: bool = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("request_id", "entity_id", "attributes", "model_name", "explain")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: AttributeValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[AttributeValue, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENTITY_ID_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    entity_id: str
    attributes: _containers.MessageMap[str, AttributeValue]
    model_name: str
    explain: bool
    def __init__(self, request_id: _Optional[str] = ..., entity_id: _Optional[str] = ..., attributes: _Optional[_Mapping[str, AttributeValue]] = ..., model_name: _Optional[str] = ..., explain: bool = ...) -> None: ...

class FeatureContribution(_message.Message):
    __slots__ = ("feature", "contribution", "reason_code", "text")
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    REASON_CODE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    feature: str
    contribution: float
    reason_code: str
    text: str
    def __init__(self, feature: _Optional[str] = ..., contribution: _Optional[float] = ..., reason_code: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class RequestWarning(_message.Message):
    __slots__ = ("code", "field", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    field: str
    message: str
    def __init__(self, code: _Optional[str] = ..., field: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("request_id", "decision_id", "probability", "decision", "reason_codes", "model_version", "feature_schema_version", "from_cache", "policy_version", "decision_label", "spread", "contributions", "top_reasons", "calibration_method", "stale", "cache_age_ms", "degraded_reason", "fallback", "replayed", "decided_at", "warnings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REASON_CODES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    FROM_CACHE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DECISION_LABEL_FIELD_NUMBER: _ClassVar[int]
    SPREAD_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    TOP_REASONS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_METHOD_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    CACHE_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decision_id: str
    probability: float
    decision: Decision
    reason_codes: _containers.RepeatedScalarFieldContainer[str]
    model_version: str
    feature_schema_version: str
    from_cache: bool
    policy_version: str
    decision_label: str
    spread: float
    contributions: _containers.RepeatedCompositeFieldContainer[FeatureContribution]
    top_reasons: _containers.RepeatedScalarFieldContainer[str]
    calibration_method: str
    stale: bool
    cache_age_ms: int
    degraded_reason: str
    fallback: bool
    replayed: bool
    decided_at: _timestamp_pb2.Timestamp
    warnings: _containers.RepeatedCompositeFieldContainer[RequestWarning]
    def __init__(self, request_id: _Optional[str] = ..., decision_id: _Optional[str] = ..., probability: _Optional[float] = ..., decision: _Optional[_Union[Decision, str]] = ..., reason_codes: _Optional[_Iterable[str]] = ..., model_version: _Optional[str] = ..., feature_schema_version: _Optional[str] = ..., from_cache: bool = ..., policy_version: _Optional[str] = ..., decision_label: _Optional[str] = ..., spread: _Optional[float] = ..., contributions: _Optional[_Iterable[_Union[FeatureContribution, _Mapping]]] = ..., top_reasons: _Optional[_Iterable[str]] = ..., calibration_method: _Optional[str] = ..., stale: bool = ..., cache_age_ms: _Optional[int] = ..., degraded_reason: _Optional[str] = ..., fallback: bool = ..., replayed: bool = ..., decided_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., warnings: _Optional[_Iterable[_Union[RequestWarning, _Mapping]]] = ...) -> None: ...

class BatchPredictRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[PredictRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[PredictRequest, _Mapping]]] = ...) -> None: ...

class BatchPredictResult(_message.Message):
    __slots__ = ("prediction", "error")
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    prediction: PredictResponse
    error: _status_pb2.Status
    def __init__(self, prediction: _Optional[_Union[PredictResponse, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class BatchPredictResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[BatchPredictResult]
    def __init__(self, results: _Optional[_Iterable[_Union[BatchPredictResult, _Mapping]]] = ...) -> None: ...

class PredictColumnsRequest(_message.Message):
    __slots__ = ("model_name", "arrow_ipc", "chunk_id")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    arrow_ipc: bytes
    chunk_id: int
    def __init__(self, model_name: _Optional[str] = ..., arrow_ipc: _Optional[bytes] = ..., chunk_id: _Optional[int] = ...) -> None: ...

class PredictColumnsResponse(_message.Message):
    __slots__ = ("chunk_id", "arrow_ipc", "error", "decided", "replayed", "failed", "warnings")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DECIDED_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    chunk_id: int
    arrow_ipc: bytes
    error: _status_pb2.Status
    decided: int
    replayed: int
    failed: int
    warnings: _containers.RepeatedCompositeFieldContainer[RequestWarning]
    def __init__(self, chunk_id: _Optional[int] = ..., arrow_ipc: _Optional[bytes] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., decided: _Optional[int] = ..., replayed: _Optional[int] = ..., failed: _Optional[int] = ..., warnings: _Optional[_Iterable[_Union[RequestWarning, _Mapping]]] = ...) -> None: ...

class DecisionOutcome(_message.Message):
    __slots__ = ("request_id", "entity_id", "decided_at", "model_name", "label", "observed_at")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENTITY_ID_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_AT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    entity_id: str
    decided_at: _timestamp_pb2.Timestamp
    model_name: str
    label: str
    observed_at: _timestamp_pb2.Timestamp
    def __init__(self, request_id: _Optional[str] = ..., entity_id: _Optional[str] = ..., decided_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., model_name: _Optional[str] = ..., label: _Optional[str] = ..., observed_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RecordOutcomesRequest(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[DecisionOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[DecisionOutcome, _Mapping]]] = ...) -> None: ...

class OutcomeStored(_message.Message):
    __slots__ = ("request_id", "duplicate", "decision_found")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    DECISION_FOUND_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    duplicate: bool
    decision_found: bool
    def __init__(self, request_id: _Optional[str] = ..., duplicate: bool = ..., decision_found: bool = ...) -> None: ...

class RecordOutcomeResult(_message.Message):
    __slots__ = ("stored", "error")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    stored: OutcomeStored
    error: _status_pb2.Status
    def __init__(self, stored: _Optional[_Union[OutcomeStored, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class RecordOutcomesResponse(_message.Message):
    __slots__ = ("results", "stored", "duplicates", "refused")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RecordOutcomeResult]
    stored: int
    duplicates: int
    refused: int
    def __init__(self, results: _Optional[_Iterable[_Union[RecordOutcomeResult, _Mapping]]] = ..., stored: _Optional[int] = ..., duplicates: _Optional[int] = ..., refused: _Optional[int] = ...) -> None: ...

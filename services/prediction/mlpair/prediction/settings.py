"""PredictionService settings, from ``PREDICTION_*`` environment variables or CLI flags.

In this order: the process and its peers (ports, InferenceService, model source, families);
batching (``inference_max_batch_rows``, ``coalesce_*``, ``merge_*``) and priorities; request limits
(``max_batch_items``, ``max_chunk_rows``), workers, shutdown and logs; the cache; the
deadline budget, retry budget (``inference_max_attempts``) and circuit breaker; callers and their
limits; the decision ledger and its relay; observability; outcome feedback; audit records and
decision events; TLS. Each field's docstring says what it does and its unit."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from mlpair.rpc.server import ConnectionSettings


class PredictionSettings(ConnectionSettings):
    """Everything the prediction server reads; built once in ``main()`` and passed down."""

    model_config = SettingsConfigDict(
        env_prefix="PREDICTION_", extra="ignore", protected_namespaces=(), use_attribute_docstrings=True
    )

    host: str = "127.0.0.1"
    """Interface the gRPC and metrics ports (and `mlpair relay`'s two) bind to: loopback, so a local run
    is reachable from this machine only; 0.0.0.0 (every interface) where others must reach it, as the
    images and manifests set."""
    port: int = 9001
    """gRPC port (0 picks a free one)."""
    metrics_port: int = 9002
    """Prometheus HTTP port; 0 disables the exporter."""
    inference_target: str = "127.0.0.1:8001"
    """InferenceService as a gRPC target: host:port, or several replicas as dns:///name:port (a
    headless Service) or ipv4:host:port,host:port (docs/reliability.md, "Containment")."""
    inference_load_balancing: Literal["pick_first", "round_robin"] = "pick_first"
    """pick_first: one connection (behind the mesh, which balances each call); round_robin: each call to
    the next replica the target resolves to that is SERVING by gRPC client-side health checking."""
    inference_timeout_ms: int = 1000
    """Longest deadline of one Infer call, in milliseconds; the caller's remaining deadline can shorten it."""
    crm_url: str = "sqlite+aiosqlite:///var/crm.sqlite"
    """SQLAlchemy async URL of the CRM database (e.g. postgresql+asyncpg://…)."""
    model_repository: Path = Path("var/models")
    """Model repository root; the fitted preprocessing and calibration are read from it (model_source empty)."""
    model_source: str = ""
    """The repository's URI when it is not a local folder: ``s3://bucket/prefix`` or ``models:/…`` (as
    INFERENCE_MODEL_SOURCE); the versions decided with are fetched into model_cache_dir. Empty = model_repository."""
    model_cache_dir: Path = Path("var/model-cache")
    """Node-local cache of versions fetched from model_source, keyed by content digest (shared with InferenceService
    on the same node when given the same folder)."""
    model_cache_max_bytes: int = 4 * 2**30
    """Bytes model_cache_dir may hold; least recently used versions are evicted beyond it (0 = no bound)."""
    source_retry_max_s: float = 30.0
    """Longest wait, in seconds, between tries of an unreachable model_source at start (0.5 s doubling)."""
    config_dir: Path = Path("config")
    """Folder with ``<model_name>/feature-schema.toml`` and ``<model_name>/policy.toml``."""
    model_name: str = "credit-risk"
    """Model family served when a request names none."""
    models: list[str] = []
    """Model families served (each needs config_dir/<name>/ and a trained model); empty = model_name alone."""
    ensembles: dict[str, list[str]] = {}
    """Model family → versions whose mean calibrated probability decides (JSON); absent = the latest alone."""
    shadows: dict[str, str] = {}
    """Model family → a version also scored for every decision, compared in metrics, never served (JSON)."""
    inference_max_batch_rows: int = 1024
    """Most rows per Infer call; InferenceService runs a call above its max_batch_size as several
    batches (up to its max_request_rows, default 8192), so this may exceed it."""
    coalesce_max_delay_ms: float = 5.0
    """Longest a request's rows wait, while an Infer call of the same model version is in flight, to share the next call with other requests' rows, in milliseconds."""
    merge_max_calls: PositiveInt = 64
    """Most concurrent Predict calls decided together as one batch (docs/decisions/0006-merged-predicts.md); 1 decides each alone."""
    merge_max_delay_ms: NonNegativeFloat = 5.0
    """Longest a Predict call waits, while a batch is being decided, to be decided with the calls that arrive after it, in milliseconds (never more than a tenth of its deadline's budget)."""
    merge_wait_from_calls: PositiveInt = 4
    """Predict calls being decided from which a new call waits (up to merge_max_delay_ms) to be decided with the calls after it; below it, calls go at once (waiting would only add latency on a lightly loaded server)."""
    priority_levels: PositiveInt = 2
    """InferenceService's priority_levels: levels 1 (highest) … this exist; an x-priority beyond is refused."""
    priority_online: PositiveInt = 1
    """Priority level of Predict calls (online), sent to InferenceService with their Infer calls."""
    priority_bulk: PositiveInt = 2
    """Priority level of BatchPredict and PredictColumns calls (bulk)."""
    priority_allow_raise: bool = False
    """Whether a caller's x-priority may ask for a higher level than its RPC's default (a lower one always may)."""
    max_batch_items: int = 1000
    """Most items one BatchPredict call may carry; more is INVALID_ARGUMENT."""
    max_chunk_rows: PositiveInt = 10_000
    """Most rows one PredictColumns chunk may carry; a larger chunk is refused as a whole (its response's error, INVALID_ARGUMENT) and the stream goes on. A chunk and its decisions must also fit in max_message_bytes."""
    unknown_attributes: Literal["warn", "refuse"] = "warn"
    """Attributes the feature schema does not know: warn (decide, and name each in the response's warnings) or refuse (INVALID_ARGUMENT, reason UNKNOWN_ATTRIBUTE)."""
    explain_top_reasons: int = 3
    """Top reasons, in business language, returned with an explanation."""
    max_message_bytes: int = 4 * 1024 * 1024
    """gRPC message size limit, both directions, in bytes."""
    workers: int = 0
    """Serving processes sharing the gRPC port under one supervisor (docs/decisions/0015), each with its own
    ledger pool, relay and caches; 0 = one per CPU of the container's limit (cgroup cpu.max or CFS quota,
    else the CPUs available)."""
    shutdown_grace_s: float = 20.0
    """Seconds in-flight requests get to finish after SIGTERM before the server exits (`mlpair relay`: its
    batches in flight)."""
    shutdown_accept_ms: int = 500
    """Milliseconds calls are still accepted after SIGTERM (health already NOT_SERVING), so calls sent just before it are served, not cancelled."""
    log_level: str = "INFO"
    """Root log level."""
    log_format: Literal["text", "json"] = "text"
    """Log line format: readable text locally, JSON lines in production."""
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    """The asyncio event loop of each process (`mlpair relay` too): uvloop (libuv) or the standard
    library's. uvloop spends less CPU on the loop's own work per call (docs/decisions/0009); it
    rounds timers to the nearest whole millisecond, and this service's delays (merge and coalesce
    waits, backoffs) are 1 ms and more."""

    # Caching with a stale fallback (cache.py).
    cache_backend: Literal["memory", "redis", "off"] = "memory"
    """Where inference results are cached: in-process LRU, a shared Redis, or not at all."""
    cache_fresh_ttl_s: float = 300.0
    """Seconds a cached result is served as fresh (from_cache = true) without calling InferenceService."""
    cache_stale_ttl_s: float = 86400.0
    """Seconds a cached result may still be served, marked stale, while InferenceService is unavailable."""
    cache_max_entries: int = 50_000
    """Most results the in-process cache holds (least recently used are evicted)."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis URL when cache_backend = redis."""
    redis_key_prefix: str = "mlpair:prediction:"
    """Prefix of every Redis key this service writes."""
    redis_timeout_ms: int = 50
    """Longest a request waits for a Redis command, connection wait included, in milliseconds; a
    slower cache counts as a miss (``prediction_cache_errors_total{reason}``)."""
    redis_max_connections: int = 16
    """Most connections to Redis each process (each worker) opens; a command that finds none free
    within ``redis_timeout_ms`` is a miss (reason ``no_connection``), never a new connection."""
    redis_reply_timeout_ms: int = 1000
    """How long a connection waits for a reply its caller stopped waiting for, in milliseconds (at
    least ``redis_timeout_ms``): a late reply is read and the connection reused, not replaced; one
    later than this drops its connection (redis-py cannot reuse a connection with a reply in flight)."""

    # Deadline budget, retries and circuit breaker around InferenceService (resilience.py).
    crm_reserve_ms: int = 20
    """Milliseconds of the caller's deadline kept back from inference for recording the decision."""
    inference_min_attempt_ms: int = 5
    """An Infer attempt is not started with less budget than this, in milliseconds: the call is
    refused DEADLINE_EXCEEDED (``DEADLINE_TOO_SHORT``), nothing decided, unless the circuit is open.
    Above the p99 of a direct Infer call at 1 in flight on loopback (docs/performance.md,
    PredictionService end to end): less cannot finish even against an idle InferenceService. Raise
    it where the hop is longer."""
    inference_max_attempts: int = 2
    """Infer attempts per call, the first included; only inference-side faults are retried (UNAVAILABLE,
    a failed model batch or another INTERNAL, UNKNOWN), each attempt a new pick of a replica."""
    inference_retry_backoff_ms: int = 10
    """Base of the full-jitter exponential backoff between Infer attempts, in milliseconds."""
    inference_reconnect_backoff_max_ms: int = 1000
    """Longest wait between reconnection attempts of the inference channel, in milliseconds."""
    inference_keepalive_ms: int = 10_000
    """Keepalive ping interval on the InferenceService channel, in ms (0 = none): a connection to a node
    that vanished without a TCP reset is dropped within this plus inference_keepalive_timeout_ms, not
    after the kernel's ~15 minutes. At least InferenceService's keepalive_min_ping_interval_ms."""
    inference_keepalive_timeout_ms: int = 5_000
    """Milliseconds a keepalive ping may go unanswered before the InferenceService connection is dropped."""
    breaker_failure_threshold: int = 5
    """Consecutive unavailable/timed-out Infer calls that open the circuit."""
    breaker_open_ms: int = 2000
    """Milliseconds the circuit stays open before half-open probes are let through."""
    breaker_half_open_probes: int = 1
    """Infer calls allowed at once while half-open; their outcome closes or reopens the circuit."""

    # Who asks, and how much each caller may ask (intake/callers.py, intake/limits.py).
    caller_source: Literal["none", "tls", "mesh", "header"] = "none"
    """Where a call's caller is read from, and only there: mesh (the SPIFFE id in the x-forwarded-client-cert
    header the mesh's sidecar sets), tls (the client certificate's subject; needs tls_client_ca_file), header
    (caller_header, set by an authenticating proxy in front), none (every caller is anonymous)."""
    caller_header: str = "x-caller-id"
    """The header caller_source = header reads (lower case)."""
    caller_limits: dict[str, float] = {}
    """Decisions per second each caller may ask for, by caller id, "*" for every caller not named (JSON, e.g.
    {"spiffe://cluster.local/ns/lending/sa/web": 50, "*": 500}); empty = no limit. A refused call is
    RESOURCE_EXHAUSTED (CALLER_RATE_LIMITED) with RetryInfo, nothing decided or recorded."""
    caller_burst_s: PositiveFloat = 1.0
    """A caller's burst, as seconds of its rate (at least one decision): the most decisions one call, or a run
    of calls after a pause, may take at once; must cover the largest BatchPredict the caller sends."""
    caller_limit_backend: Literal["memory", "redis"] = "memory"
    """Where the limits are kept: in each process (memory: every replica and worker limits alone), or in
    Redis at redis_url (shared by every replica: one atomic script per call)."""
    caller_limit_redis_failure: Literal["open", "closed"] = "open"
    """When Redis does not answer within redis_timeout_ms: admit the call (open) or refuse it UNAVAILABLE
    (closed, CALLER_LIMIT_UNAVAILABLE); counted in prediction_caller_limit_errors_total either way."""
    callers: list[str] = []
    """Callers given their own label in prediction_caller_decisions_total besides those caller_limits names;
    every other caller is counted as "other" (and callers with no identity as "anonymous")."""

    # Durable decisions: the shared decision ledger and its relay to the CRM database (recording/).
    ledger_url: str = "sqlite+aiosqlite:///var/prediction-ledger.sqlite"
    """SQLAlchemy async URL of the decision ledger every replica shares (postgresql+asyncpg://… for replicas; a SQLite file for one machine); created by `mlpair migrate`."""
    ledger_timeout_ms: int = 2000
    """Connect, pool and statement timeout of the decision ledger, in milliseconds; a decision not recorded in time is UNAVAILABLE."""
    ledger_pool_size: int = 4
    """Most PostgreSQL connections to the ledger per process (group commits, relay claims, probes)."""
    ledger_statement_cache_size: int = 100
    """Prepared statements asyncpg keeps per ledger connection; 0 behind PgBouncer in transaction mode."""
    crm_statement_cache_size: int = 100
    """PostgreSQL CRM only: prepared statements asyncpg (through SQLAlchemy) keeps per connection; 0 behind
    PgBouncer in transaction mode, where a statement prepared on one server connection is unknown on the next."""
    ledger_synchronous: Literal["FULL", "NORMAL"] = "FULL"
    """SQLite ledger only: FULL fsyncs each commit (survives power loss), NORMAL survives a process crash only."""
    relay_batch_size: int = 2048
    """Most decisions the relay delivers to the CRM in one transaction."""
    relay_concurrency: int = 3
    """Most batches the relay claims and delivers at once while a backlog lasts (PostgreSQL ledger only). Each
    holds a ledger connection for its delivery, so a serving process's relay takes at most ledger_pool_size minus
    the 3 kept for commits (one with the default pool of 4, three with 6), and `mlpair relay`, where nothing
    commits, all but one (three with 4) (docs/decisions/0007-relay-in-its-own-process.md)."""
    relay_linger_ms: int = 50
    """Milliseconds the relay waits after a commit for more decisions, so one CRM transaction carries many (a
    serving process's relay only: `mlpair relay` sees no commits and looks every relay_poll_ms)."""
    relay_backoff_max_ms: int = 5000
    """Longest full-jitter wait between relay retries while the CRM database is down, in milliseconds."""
    relay_in_process: bool = True
    """Run the outbox relay in each serving process (each worker); false: the serving processes only record
    decisions in the ledger and `mlpair relay`, a process of its own, delivers them (docs/deployment.md)."""
    relay_poll_ms: PositiveInt = 100
    """`mlpair relay` only: milliseconds between its looks at the ledger for undelivered decisions (no commit of
    its own process wakes it), so a decision reaches the CRM at most about this much later than in-process."""
    relay_port: int = 9003
    """`mlpair relay` only: its grpc.health.v1 port (liveness, and readiness while the ledger answers); 0 picks a free one."""
    relay_metrics_port: int = 9004
    """`mlpair relay` only: its Prometheus HTTP port (the prediction_* relay and backlog metrics); 0 disables it."""
    crm_timeout_ms: int = 5000
    """Connect and statement timeout of the CRM database, in milliseconds."""
    health_interval_ms: int = 1000
    """Milliseconds between checks of the ledger, CRM, cache and InferenceService for health (`mlpair relay`:
    the ledger and the CRM)."""

    # -- Observability (issue 6) ----------------------------------------------------------------
    tracing: bool = True
    """OpenTelemetry spans with W3C trace context (also on the Infer call) and per-call log context
    on every RPC (its CPU per call: docs/observability.md, Overhead); off only where that matters
    more than traces."""
    otlp_endpoint: str = ""
    """OTLP/gRPC collector for traces (e.g. http://otel-collector:4317); empty = the standard
    OTEL_EXPORTER_OTLP_ENDPOINT (and OTEL_EXPORTER_OTLP_* options) when set, else no export."""
    trace_sample_ratio: float = 1.0
    """Fraction of new traces recorded when exporting; a caller's sampling decision is kept. When not
    set, the standard OTEL_TRACES_SAMPLER (+ OTEL_TRACES_SAMPLER_ARG) decides, if set, else 1.0."""
    log_sample_ratio: float = 0.0
    """Fraction of decisions logged at INFO when DEBUG is off (0 = none; per-decision lines are DEBUG)."""
    drift_window_rows: int = 1000
    """Decisions in the sliding window each drift evaluation looks at."""
    drift_min_rows: int = 200
    """Fewest decisions in the window before drift is judged at all."""
    drift_ks_threshold: float = 0.15
    """KS statistic above which a numeric feature (or the score) may drift (docs/design.md's alarm)."""
    drift_categorical_threshold: float = 0.15
    """Total variation distance above which a categorical feature may drift."""
    drift_alpha: float = 0.01
    """Family-wise significance of one evaluation; each test uses alpha / number of tests (Bonferroni)."""
    drift_interval_s: float = 30.0
    """Seconds between drift evaluations (0 disables the periodic evaluation)."""

    # -- Outcome feedback (RecordOutcomes, realised performance) ----------------------------
    max_outcome_items: PositiveInt = 10_000
    """Most outcomes one RecordOutcomes call may carry; more is INVALID_ARGUMENT."""
    outcome_refresh_s: float = 60.0
    """Seconds between refreshes of the prediction_realised_* gauges (0 disables them)."""
    outcome_windows_h: list[float] = [168.0, 720.0, 2160.0]
    """Windows of decision time the realised figures cover, in hours back from now (0: all on record)."""
    outcome_min_joined: PositiveInt = 100
    """Fewest decisions joined with outcomes before a family, version and window's figures are exported."""

    # -- The decision's record and events (recording/audit.py, recording/event_relay.py) ----------
    audit_records: bool = True
    """Keep, beside each decision, what it was based on (attributes as received, feature vector, guards, logits,
    explanation) in the ledger's decision_audit table, committed with it; `mlpair decision REQUEST_ID` shows it."""
    audit_personal_data: Literal["drop", "hash"] = "drop"
    """Attributes the schema flags personal_data: left out of audit records and events (drop) or stored as their
    HMAC-SHA256 under audit_hash_key (hash), so a holder of the key can check a claimed value."""
    audit_hash_key: SecretStr = SecretStr("")
    """The HMAC key of audit_personal_data = hash (a secret of at least 16 bytes, from a Secret)."""
    audit_retention_days: NonNegativeFloat = 0.0
    """Audit records older than this are deleted by the relay (the decisions stay); 0 keeps them."""
    events_url: str = ""
    """NATS server of the decision events (nats://host:4222): every decision is published as a CloudEvent to
    JetStream by the relay, from the ledger's event outbox (PostgreSQL ledger); empty = no events."""
    events_subject: str = "mlpair.decisions"
    """Subject the decision events are published on."""
    events_stream: str = "MLPAIR_DECISIONS"
    """JetStream stream holding events_subject (created with events_duplicate_window_s when missing)."""
    events_mode: Literal["structured", "binary"] = "structured"
    """CloudEvents content mode: structured (the envelope as JSON) or binary (ce-* headers, data as the body)."""
    events_duplicate_window_s: PositiveFloat = 600.0
    """JetStream's message-id de-duplication window, in seconds, for a stream this service creates; a relay
    retrying a claim within it adds no copy (consumers deduplicate by the event id beyond it)."""
    events_batch_size: PositiveInt = 512
    """Most decisions the event relay publishes per claim (published at once, acknowledged together)."""

    # -- TLS (when not behind a mesh that terminates mTLS) ----------------------------------
    tls_cert_file: Path | None = None
    """PEM certificate chain of the gRPC port; with tls_key_file, the port speaks TLS only."""
    tls_key_file: Path | None = None
    """PEM private key of tls_cert_file."""
    tls_client_ca_file: Path | None = None
    """PEM CA bundle; when set, callers must present a certificate it signed (mutual TLS)."""
    inference_tls_ca_file: Path | None = None
    """PEM CA bundle that signed InferenceService's certificate; set = call InferenceService over TLS."""
    inference_tls_cert_file: Path | None = None
    """PEM client certificate presented to InferenceService (when it requires mutual TLS)."""
    inference_tls_key_file: Path | None = None
    """PEM private key of inference_tls_cert_file."""

    @model_validator(mode="after")
    def _priorities_are_levels(self) -> PredictionSettings:
        if max(self.priority_online, self.priority_bulk) > self.priority_levels:
            raise ValueError("priority_online and priority_bulk must be levels 1..priority_levels")
        return self

    @model_validator(mode="after")
    def _ledger_is_its_own(self) -> PredictionSettings:
        if self.ledger_url.startswith("sqlite") and self.ledger_url == self.crm_url:
            raise ValueError("a SQLite decision ledger is a file of its own: ledger_url must differ from crm_url")
        return self

    @model_validator(mode="after")
    def _tls_is_consistent(self) -> PredictionSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        if (self.inference_tls_cert_file is None) != (self.inference_tls_key_file is None):
            raise ValueError("inference_tls_cert_file and inference_tls_key_file go together")
        if self.inference_tls_cert_file is not None and self.inference_tls_ca_file is None:
            raise ValueError("an inference client certificate needs inference_tls_ca_file (TLS to InferenceService)")
        return self

    @model_validator(mode="after")
    def _record_is_consistent(self) -> PredictionSettings:
        if self.audit_personal_data == "hash" and len(self.audit_hash_key.get_secret_value().encode()) < 16:
            raise ValueError(
                "PREDICTION_AUDIT_PERSONAL_DATA=hash needs PREDICTION_AUDIT_HASH_KEY (--audit-hash-key), "
                "a secret of at least 16 bytes"
            )
        if self.events_url and not self.ledger_url.startswith("postgresql"):
            raise ValueError(
                "PREDICTION_EVENTS_URL: decision events are relayed from the PostgreSQL ledger's outbox; set "
                "PREDICTION_LEDGER_URL to a PostgreSQL ledger, or unset PREDICTION_EVENTS_URL"
            )
        return self

    @model_validator(mode="after")
    def _callers_are_consistent(self) -> PredictionSettings:
        if self.caller_source == "tls" and self.tls_client_ca_file is None:
            raise ValueError("caller_source = tls reads client certificates: it needs tls_client_ca_file (mutual TLS)")
        for caller, rate in self.caller_limits.items():
            if not rate > 0 or rate == float("inf"):
                raise ValueError(
                    f"caller_limits: the limit of {caller!r} must be a positive number of decisions per second"
                )
        return self

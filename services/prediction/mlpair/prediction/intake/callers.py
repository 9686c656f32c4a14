"""Who is asking: each call's caller, established once in intake and carried with its decisions.

The source is the operator's choice (``PREDICTION_CALLER_SOURCE``), and only that source is read;
every other place a client could name itself is ignored, so a caller cannot claim another's
identity through a header nothing trusted set:

* ``mesh`` — behind a service mesh that terminates mTLS in a sidecar: the client workload's SPIFFE
  id, the ``URI=spiffe://…`` of the **last** element of Envoy's ``x-forwarded-client-cert`` (XFCC)
  header. Envoy's connection manager decides what happens to an XFCC header a client sent
  (``forward_client_cert_details``, https://envoyproxy.io/docs/envoy/latest/configuration/http/http_conn_man/headers,
  "x-forwarded-client-cert"): ``SANITIZE_SET`` drops the client's header and sets one element of
  its own for the mTLS peer; ``APPEND_FORWARD``, which Istio's inbound sidecar uses, keeps what
  came in and appends the element of the peer it authenticated. The last element is the sidecar's
  in both, never the client's; a plaintext client that reaches the pod without the sidecar is
  what the mesh's ``PeerAuthentication`` in ``STRICT`` mode excludes (docs/deployment.md).
* ``tls`` — this server terminates TLS with client authentication (``PREDICTION_TLS_CLIENT_CA_FILE``):
  the client certificate's subject as gRPC verified it (``x509_subject``, else its common name).
* ``header`` — a plain header (``PREDICTION_CALLER_HEADER``, default ``x-caller-id``) that an
  authenticating proxy in front sets; only for deployments where nothing else can reach the port.
* ``none`` (the default) — no identity is read.

A call with no identity from its source is ``anonymous``. An identity that is not a usable id
(control characters, longer than 128 characters, an XFCC header that does not parse) is refused
INVALID_ARGUMENT (``CALLER_INVALID``), never recorded as someone else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from mlpair.prediction.errors import InvalidCaller

ANONYMOUS = "anonymous"
OTHER = "other"  # the metric label of every caller not named in the settings
XFCC = "x-forwarded-client-cert"
MAX_CALLER = 128
CallerSource = Literal["none", "tls", "mesh", "header"]


def identify(context, source: CallerSource, header: str = "x-caller-id") -> str:
    """The caller of the call behind ``context`` (a ``grpc.aio.ServicerContext``), read from
    ``source`` only.

    Raises:
        InvalidCaller: the source's value is not a usable caller id.
    """
    if source == "none":
        return ANONYMOUS
    if source == "tls":
        return _checked(_certificate_subject(context.auth_context()), "the client certificate's subject")
    wanted = XFCC if source == "mesh" else header
    value = _header(context.invocation_metadata() or (), wanted)
    if value is None:
        return ANONYMOUS
    if source == "mesh":
        return _checked(spiffe_id(value), f"the {XFCC} header's URI")
    return _checked(value, f"the {header} header")


def spiffe_id(xfcc: str) -> str | None:
    """The ``URI`` of the last element of an XFCC header value when it is a SPIFFE id, else None.

    Elements are separated by commas, their ``key=value`` pairs by semicolons; a value may be
    double-quoted (then commas and semicolons inside it are part of it).

    Raises:
        InvalidCaller: an unterminated quoted value.
    """
    elements = _split(xfcc, ",")
    if not elements:
        return None
    for pair in _split(elements[-1], ";"):
        key, _, value = pair.partition("=")
        if key.strip().lower() == "uri":
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1]
            return value if value.startswith("spiffe://") else None
    return None


def metric_label(caller: str, named: frozenset[str]) -> str:
    """The caller as a metric label: itself when the settings name it (or ``anonymous``), else
    ``other``, so clients cannot mint label values."""
    return caller if caller in named or caller == ANONYMOUS else OTHER


def _split(text: str, sep: str) -> list[str]:
    out: list[str] = []
    part: list[str] = []
    quoted = False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch == sep and not quoted:
            out.append("".join(part))
            part = []
        else:
            part.append(ch)
    if quoted:
        raise InvalidCaller(f"the {XFCC} header has an unterminated quoted value")
    out.append("".join(part))
    return [p for p in out if p.strip()]


def _header(metadata: Iterable[tuple[str, str | bytes]], name: str) -> str | None:
    for key, value in metadata:
        if key == name:
            return value.decode("ascii", "replace") if isinstance(value, bytes) else value
    return None


def _certificate_subject(auth: Mapping[str, list[bytes]]) -> str | None:
    for key in ("x509_subject", "x509_common_name"):
        values = auth.get(key)
        if values:
            return values[0].decode("utf-8", "replace")
    return None


def _checked(value: str | None, what: str) -> str:
    if value is None or value == "":
        return ANONYMOUS
    if len(value) > MAX_CALLER or not value.isprintable():
        raise InvalidCaller(f"{what} is not a usable caller id (printable, at most {MAX_CALLER} characters)")
    return value

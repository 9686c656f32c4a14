"""TLS credentials for a server port and for a client channel (None = plaintext, e.g. behind a
mesh that does mTLS)."""

from __future__ import annotations

from pathlib import Path

import grpc


def server_credentials(
    cert_file: Path | None, key_file: Path | None, client_ca_file: Path | None = None
) -> grpc.ServerCredentials | None:
    """TLS credentials for a server port, or None for plaintext.

    Args:
        cert_file, key_file: PEM certificate chain and private key of this server; both or neither.
        client_ca_file: PEM CA bundle; when set, clients must present a certificate it signed (mTLS).

    Raises:
        ValueError: only one of cert and key, or a client CA without them.
        OSError: a file cannot be read.
    """
    if cert_file is None and key_file is None:
        if client_ca_file is not None:
            raise ValueError("a TLS client CA needs the server's own certificate and key")
        return None
    if cert_file is None or key_file is None:
        raise ValueError("TLS needs both a certificate file and a key file")
    return grpc.ssl_server_credentials(
        [(Path(key_file).read_bytes(), Path(cert_file).read_bytes())],
        root_certificates=Path(client_ca_file).read_bytes() if client_ca_file else None,
        require_client_auth=client_ca_file is not None,
    )


def channel_credentials(
    ca_file: Path | None, cert_file: Path | None = None, key_file: Path | None = None
) -> grpc.ChannelCredentials | None:
    """TLS credentials for a client channel, or None for plaintext.

    Args:
        ca_file: PEM CA bundle that signed the server's certificate; None = plaintext.
        cert_file, key_file: this client's certificate and key, for a server that requires mTLS.

    Raises:
        ValueError: a client certificate without TLS, or only one of cert and key.
        OSError: a file cannot be read.
    """
    if ca_file is None:
        if cert_file is not None or key_file is not None:
            raise ValueError("a TLS client certificate needs the CA file of the server's certificate")
        return None
    if (cert_file is None) != (key_file is None):
        raise ValueError("a TLS client certificate needs both a certificate file and a key file")
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca_file).read_bytes(),
        private_key=Path(key_file).read_bytes() if key_file else None,
        certificate_chain=Path(cert_file).read_bytes() if cert_file else None,
    )

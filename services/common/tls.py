"""Optional mutual TLS on the internal hops (docs/operating/security.md, "TLS between the
services"): edge -> tokenizer -> scheduler -> workers, and Envoy -> edge/tokenizer.

Every service reads the same four settings (same names everywhere, so one
environment or one ConfigMap serves the whole chain); all three files set turn
it on, none leaves every hop plaintext:

- internal_tls_cert_file / internal_tls_key_file: this process's certificate and
  key, served to its callers and presented to the services it calls (one
  certificate with both usages, server auth and client auth);
- internal_tls_ca_file: the CA that signs them: a peer whose certificate it did
  not sign is refused, in both directions;
- internal_tls_server_name: the name every client checks in the server's
  certificate (a DNS SAN). The scheduler dials workers by pod IP, which no
  certificate can list, so no client checks the address it dialled.

The files are read when a server starts and when a channel is made: a renewed
certificate reaches a process when it restarts (docs/operating/security.md)."""
from __future__ import annotations

import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.config import require, setting

if TYPE_CHECKING:  # configs, Envoy's launcher and the supervisor import this module: grpc only where used
    import grpc

DEFAULT_SERVER_NAME = "stormserve.internal"
_DNS_NAME = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$")


def health_port_setting() -> Any:
    return setting(0, "plaintext port serving only grpc.health.v1, for probes that cannot present a client "
                      "certificate (Kubernetes gRPC probes) when internal TLS is on; 0 = none")


def check_internal_tls(config: Any) -> None:
    """For a config's __post_init__: all three files or none, a DNS server name,
    and a health_port (where the config has one) that is a port."""
    files = (config.internal_tls_cert_file, config.internal_tls_key_file, config.internal_tls_ca_file)
    require(all(files) or not any(files),
            "internal TLS needs all of internal_tls_cert_file, internal_tls_key_file and internal_tls_ca_file "
            "(or none of them: off)")
    require(bool(_DNS_NAME.match(config.internal_tls_server_name)),
            f"internal_tls_server_name must be a DNS name, got {config.internal_tls_server_name!r}")
    health_port = getattr(config, "health_port", 0)
    require(0 <= health_port <= 65535, f"health_port must be in [0, 65535], got {health_port}")


def _read(what: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"internal TLS: cannot read the {what} {path}: {exc.strerror}") from exc
    if b"-----BEGIN " not in data:
        raise ValueError(f"internal TLS: the {what} {path} holds no PEM")
    return data


@dataclass(frozen=True)
class InternalTlsSettings:
    """The four settings: every service's config inherits them (one name each
    everywhere), and `make run`'s supervisor reads them alone to reach the edge."""

    internal_tls_cert_file: str = setting(
        "", "internal mutual TLS: this service's certificate chain (PEM), served to its callers and presented to "
            "the services it calls; with the key and CA files turns internal TLS on")
    internal_tls_key_file: str = setting("", "internal mutual TLS: the private key (PEM) of internal_tls_cert_file")
    internal_tls_ca_file: str = setting(
        "", "internal mutual TLS: CA bundle (PEM); a peer whose certificate it did not sign is refused")
    internal_tls_server_name: str = setting(
        DEFAULT_SERVER_NAME, "internal mutual TLS: the DNS name every client checks in the certificates of the "
                             "services it calls (their DNS SAN)")

    def __post_init__(self) -> None:
        check_internal_tls(self)


@dataclass(frozen=True)
class InternalTls:
    """The files of internal mutual TLS and the server name clients verify."""

    cert_file: str
    key_file: str
    ca_file: str
    server_name: str = DEFAULT_SERVER_NAME

    @classmethod
    def of(cls, config: Any) -> InternalTls | None:
        """From a config's internal_tls_* fields; None when internal TLS is off."""
        if not config.internal_tls_ca_file:
            return None
        return cls(config.internal_tls_cert_file, config.internal_tls_key_file, config.internal_tls_ca_file,
                   config.internal_tls_server_name)

    def _pems(self) -> tuple[bytes, bytes, bytes]:
        return (_read("certificate", self.cert_file), _read("private key", self.key_file),
                _read("CA bundle", self.ca_file))

    def server_credentials(self) -> grpc.ServerCredentials:
        """A gRPC server's: it requires a client certificate the CA signed."""
        import grpc

        cert, key, ca = self._pems()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A gRPC client's: it trusts only the CA and presents this certificate."""
        import grpc

        cert, key, ca = self._pems()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        # The name checked in the server's certificate (and sent as SNI), whatever address was dialled.
        return [("grpc.ssl_target_name_override", self.server_name)]

    def server_ssl_context(self) -> ssl.SSLContext:
        """A TCP server's beside gRPC (a worker's step channel): it requires a
        client certificate the CA signed, as server_credentials does."""
        self._pems()
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def peer_ssl_context(self) -> ssl.SSLContext:
        """A TCP client's of such a server (the scheduler's step channel): it trusts
        only the CA and presents this certificate; the server's must carry
        `server_name`, to be passed as the connection's server_hostname."""
        self._pems()
        context = ssl.create_default_context(cafile=self.ca_file)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def edge_ssl_settings(self) -> dict[str, Any]:
        """uvicorn.Config's TLS arguments for the edge: HTTPS, and a client
        certificate asked for but optional at the TLS layer (kubelet probes and
        Prometheus have none); one that is sent must be from the CA, and the
        edge's protocol refuses requests without one (http_protocol.py)."""
        self._pems()
        return {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file, "ssl_ca_certs": self.ca_file,
                "ssl_cert_reqs": ssl.CERT_OPTIONAL}

    def client_ssl_context(self) -> ssl.SSLContext:
        """For an HTTPS client of the edge (the supervisor's /health check, tests):
        it trusts only the CA and presents this certificate. The address dialled
        (127.0.0.1) is not the name the certificate carries, and Python's HTTP
        clients check the address: the name is not checked here (httpx can
        check it, with the `sni_hostname` request extension)."""
        self._pems()  # a clear error for a missing file
        context = ssl.create_default_context(cafile=self.ca_file)
        context.check_hostname = False
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

"""TCP security end to end: a bearer token, TLS with a self-signed CA, mutual TLS, the unix
socket's mode, and the refusal to expose a plaintext, token-less port beyond loopback."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from sqlalchemy.engine import Engine

import batchd
from batchd import errors
from batchd_server.api import build_server
from batchd_server.api.security import TokenInterceptor, check_exposure
from batchd_server.config import ServerConfig

from serving import RECORD_FLOATS, record_dataset, tcp_server

TOKEN = "s3cret-token-0123456789abcdef"
HEALTHCHECK = [sys.executable, "-m", "batchd_server.cli", "healthcheck"]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _issue(
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    common_name: str,
    *,
    server: bool = False,
    client: bool = False,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for ``common_name``, signed by ``ca`` (self-signed CA when None)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name) if ca is None else ca[0].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    if client:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    signer = key if ca is None else ca[1]
    return builder.sign(signer, hashes.SHA256()), key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A self-signed CA, a server certificate for 127.0.0.1 and a client certificate."""
    out = tmp_path_factory.mktemp("pki")
    ca = _issue(None, "batchd test CA")
    files = {
        "ca": ca,
        "server": _issue(ca, "batchd server", server=True),
        "client": _issue(ca, "batchd trainer", client=True),
    }
    paths = {}
    for name, (cert, key) in files.items():
        paths[name] = out / f"{name}.pem"
        paths[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{name}-key"] = out / f"{name}-key.pem"
        paths[f"{name}-key"].write_bytes(_pem_key(key))
    return paths


def _epoch(target: str, **kwargs: Any) -> int:
    pipeline = batchd.Array((RECORD_FLOATS,), "float32", raw=True)
    with batchd.Loader(
        target, dataset="records", batch_size=16, pipeline=pipeline, device="cpu", **kwargs
    ) as loader:
        return sum(len(b["sample_id"]) for b in loader)


def test_a_token_server_refuses_no_token_and_a_wrong_one_and_serves_the_right_one(
    engine: Engine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No token or a wrong one: Unauthenticated (Loader and Catalog); BATCHD_AUTH_TOKEN
    right: an epoch runs. The token appears in no log line."""
    record_dataset(engine, tmp_path / "r", n=50)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    monkeypatch.delenv("BATCHD_AUTH_TOKEN", raising=False)
    caplog.set_level(logging.DEBUG)
    with tcp_server(engine, auth_token_file=token_file) as server:
        with pytest.raises(errors.Unauthenticated, match="none"):
            _epoch(server.address)
        with pytest.raises(errors.Unauthenticated, match="wrong"):
            _epoch(server.address, auth_token="not-the-token")
        with pytest.raises(errors.Unauthenticated), batchd.Catalog(server.address) as catalog:
            catalog.list_datasets()
        monkeypatch.setenv("BATCHD_AUTH_TOKEN", TOKEN)
        assert _epoch(server.address, transport="inline") == 50
        assert _epoch(server.address, transport="shm") == 50
        with batchd.Catalog(server.address) as catalog:
            assert [d.name for d in catalog.list_datasets()] == ["records"]
    assert all(TOKEN not in record.getMessage() for record in caplog.records)


def test_tls_with_a_self_signed_ca_serves_a_client_that_trusts_it_and_tells_plaintext_why(
    engine: Engine, tmp_path: Path, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """BATCHD_TLS_CA set: an epoch runs over TLS. A plaintext client gets Unavailable that
    says the server uses TLS and what to set."""
    record_dataset(engine, tmp_path / "r", n=40)
    with tcp_server(engine, tls_cert=pki["server"], tls_key=pki["server-key"]) as server:
        monkeypatch.delenv("BATCHD_TLS_CA", raising=False)
        with pytest.raises(errors.Unavailable, match="uses TLS") as caught:
            _epoch(server.address, timeout_s=5)
        assert "BATCHD_TLS_CA" in str(caught.value)
        with (
            pytest.raises(errors.Unavailable, match="uses TLS"),
            batchd.Catalog(server.address, timeout_s=5) as catalog,
        ):
            catalog.list_datasets()
        monkeypatch.setenv("BATCHD_TLS_CA", str(pki["ca"]))
        assert _epoch(server.address, transport="inline") == 40
        with batchd.Catalog(server.address) as catalog:
            assert catalog.describe_dataset("records").name == "records"


def test_mutual_tls_needs_a_client_certificate_signed_by_the_client_ca(
    engine: Engine, tmp_path: Path, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--tls-client-ca: a client without a certificate is refused; with one it is served."""
    record_dataset(engine, tmp_path / "r", n=20)
    config = {"tls_cert": pki["server"], "tls_key": pki["server-key"], "tls_client_ca": pki["ca"]}
    with tcp_server(engine, **config) as server:
        with pytest.raises(errors.Unavailable):
            _epoch(server.address, tls_ca=pki["ca"], timeout_s=5)
        monkeypatch.setenv("BATCHD_TLS_CLIENT_CERT", str(pki["client"]))
        monkeypatch.setenv("BATCHD_TLS_CLIENT_KEY", str(pki["client-key"]))
        assert _epoch(server.address, tls_ca=pki["ca"], transport="inline") == 20


def _healthcheck(target: str, *flags: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``batchd-server healthcheck --target target *flags``: its exit code and its line."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_TLS_")}
    done = subprocess.run(
        [*HEALTHCHECK, "--target", target, "--timeout-s", "10", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, **(env or {})},
    )
    assert done.returncode in (0, 1), done
    [line] = done.stdout.splitlines()
    return done.returncode, line


def test_the_healthcheck_probes_a_tls_server_with_the_ca_it_is_given(
    engine: Engine, pki: dict[str, Path]
) -> None:
    """--tls-ca (or BATCHD_TLS_CA): SERVING over TLS. Without it the line says to pass it;
    --tls-server-name checks the certificate against that name instead of the target's."""
    ca = str(pki["ca"])
    with tcp_server(engine, tls_cert=pki["server"], tls_key=pki["server-key"]) as server:
        target = server.address
        code, line = _healthcheck(target, "--tls-ca", ca)
        assert code == 0 and line.endswith(f"; the server at {target} is SERVING"), line
        assert _healthcheck(target, env={"BATCHD_TLS_CA": ca})[0] == 0
        code, line = _healthcheck(target)
        assert code == 1 and "--tls-ca" in line, line
        assert _healthcheck(target, "--tls-ca", ca, "--tls-server-name", "localhost")[0] == 0
        code, line = _healthcheck(target, "--tls-ca", ca, "--tls-server-name", "elsewhere.test")
        assert code == 1 and "--tls-server-name" in line, line


def test_the_healthcheck_presents_a_client_certificate_to_a_mutual_tls_server(
    engine: Engine, pki: dict[str, Path]
) -> None:
    """--tls-client-ca on the server: the CA alone is refused, and the line names the client
    certificate flags; with --tls-client-cert and --tls-client-key it is SERVING. An
    unreadable file is one line naming it and its flag."""
    config = {"tls_cert": pki["server"], "tls_key": pki["server-key"], "tls_client_ca": pki["ca"]}
    ca = ["--tls-ca", str(pki["ca"])]
    with tcp_server(engine, **config) as server:
        code, line = _healthcheck(server.address, *ca)
        assert code == 1 and "--tls-client-cert" in line, line
        client = [
            "--tls-client-cert",
            str(pki["client"]),
            "--tls-client-key",
            str(pki["client-key"]),
        ]
        assert _healthcheck(server.address, *ca, *client)[0] == 0
        env = {
            "BATCHD_TLS_CLIENT_CERT": str(pki["client"]),
            "BATCHD_TLS_CLIENT_KEY": str(pki["client-key"]),
        }
        assert _healthcheck(server.address, *ca, env=env)[0] == 0
        code, line = _healthcheck(server.address, *ca, "--tls-client-cert", str(pki["client"]))
        assert code == 1 and "--tls-client-key" in line, line
        missing = str(pki["ca"].parent / "missing.pem")
        code, line = _healthcheck(server.address, "--tls-ca", missing)
        assert code == 1 and missing in line and "--tls-ca" in line, line


def test_the_grpc_unix_socket_is_mode_0600(engine: Engine, tmp_path: Path) -> None:
    """Like the doorbell, the gRPC socket is the server's user's only."""
    url = engine.url.render_as_string(hide_password=False)
    config = ServerConfig(database_url=url, workers=1)
    with build_server(config, f"unix://{tmp_path}/grpc.sock"):
        mode = stat.S_IMODE((tmp_path / "grpc.sock").stat().st_mode)
    assert mode == 0o600, oct(mode)


def test_a_plaintext_tokenless_listener_beyond_loopback_refuses_to_start(
    sqlite_url: str,
) -> None:
    """0.0.0.0 without TLS or a token fails before binding and names the way out; loopback,
    TLS or a token, or --insecure are fine."""
    config = ServerConfig(database_url=sqlite_url, workers=1)
    with pytest.raises(errors.FailedPrecondition, match="--insecure"):
        build_server(config, "0.0.0.0:0")
    with pytest.raises(errors.FailedPrecondition, match="--tls-cert"):
        check_exposure("[::]", tls=False, token=False, insecure=False)
    for host in ("127.0.0.1", "localhost", "[::1]"):
        check_exposure(host, tls=False, token=False, insecure=False)
    check_exposure("0.0.0.0", tls=True, token=False, insecure=False)
    check_exposure("0.0.0.0", tls=False, token=True, insecure=False)
    check_exposure("0.0.0.0", tls=False, token=False, insecure=True)


def test_the_health_check_needs_no_token_and_everything_else_does() -> None:
    """Through a real gRPC server with the token interceptor: a health Check without a token
    is answered; a health Watch or a Loader call without one is UNAUTHENTICATED."""

    def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b"ok"

    def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"ok"

    answer_rpc = grpc.unary_unary_rpc_method_handler(answer)
    watch_rpc = grpc.unary_stream_rpc_method_handler(stream)
    handlers = [
        grpc.method_handlers_generic_handler(
            "grpc.health.v1.Health", {"Check": answer_rpc, "Watch": watch_rpc}
        ),
        grpc.method_handlers_generic_handler("batchd.v1.Loader", {"ListDatasets": answer_rpc}),
    ]
    with futures.ThreadPoolExecutor(2) as pool:
        server = grpc.server(pool, handlers=handlers, interceptors=[TokenInterceptor(b"t0k")])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = channel.unary_unary("/grpc.health.v1.Health/Check")
                assert health(b"", timeout=10) == b"ok"
                watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
                with pytest.raises(grpc.RpcError) as caught:
                    list(watch(b"", timeout=10))
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                authorized = [("authorization", "Bearer t0k")]
                assert list(watch(b"", timeout=10, metadata=authorized)) == [b"ok"]
                loader = channel.unary_unary("/batchd.v1.Loader/ListDatasets")
                with pytest.raises(grpc.RpcError) as caught:
                    loader(b"", timeout=10)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert loader(b"", timeout=10, metadata=authorized) == b"ok"
        finally:
            server.stop(None)

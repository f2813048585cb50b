"""Google Cloud Storage (``gs://BUCKET/PREFIX``) through obstore's ``GCSStore``.

Credentials come from Google's standard chain as ``object_store`` reads it: a service
account's JSON key named by ``GOOGLE_APPLICATION_CREDENTIALS`` (or
``GOOGLE_SERVICE_ACCOUNT`` / ``GOOGLE_SERVICE_ACCOUNT_PATH``, or the key itself in
``GOOGLE_SERVICE_ACCOUNT_KEY``), the application-default credentials file that ``gcloud auth
application-default login`` writes, else the metadata server (GKE workload identity, a GCE
instance's service account).

An emulator is reached the way Google's own clients are pointed at one:
``STORAGE_EMULATOR_HOST`` (``host:port`` or a URL; plain HTTP when no scheme is given).
Requests to it are unsigned unless credentials are configured, as Google's clients do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from obstore.store import GCSStore

from batchd_server.storage.cloud import IP_ADDRESS, Cloud

__all__ = ["GCS", "emulator_url"]

_BUCKET: Final = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
_CREDENTIALS: Final = (
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_PATH",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "GOOGLE_BEARER_TOKEN",
)


def emulator_url(env: Mapping[str, str]) -> str | None:
    """The emulator's base URL from ``STORAGE_EMULATOR_HOST``, or None."""
    host = (env.get("STORAGE_EMULATOR_HOST") or "").strip()
    if not host:
        return None
    return (host if "://" in host else f"http://{host}").rstrip("/")


class GCS(Cloud):
    scheme = "gs"
    env_prefixes = ("GOOGLE_", "STORAGE_EMULATOR_HOST")
    credentials_hint = (
        "GOOGLE_APPLICATION_CREDENTIALS (a service account's JSON key) or the pod's workload "
        "identity"
    )
    endpoint_hint = "STORAGE_EMULATOR_HOST"

    def bucket_problem(self, name: str) -> str | None:
        if _BUCKET.fullmatch(name) and ".." not in name and not IP_ADDRESS.fullmatch(name):
            return None
        return (
            "3 to 63 lowercase letters, digits, dots, hyphens and underscores, starting and "
            "ending with a letter or digit, not an IP address"
        )

    def endpoint(self, env: Mapping[str, str]) -> str | None:
        return emulator_url(env) or env.get("GOOGLE_BASE_URL") or None

    def make(self, bucket: str, env: Mapping[str, str], options: dict[str, Any]) -> GCSStore:
        extra: dict[str, Any] = {}
        emulator = emulator_url(env)
        if emulator is not None:
            extra["base_url"] = emulator
            if not any(env.get(k) for k in _CREDENTIALS):
                extra["skip_signature"] = True
        base = extra.get("base_url") or env.get("GOOGLE_BASE_URL") or ""
        if base.startswith("http://"):
            options["client_options"] = options["client_options"] | {"allow_http": True}
        return GCSStore(bucket, **options, **extra)

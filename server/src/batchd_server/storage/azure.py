"""Azure Blob Storage (``az://CONTAINER/PREFIX``) through obstore's ``AzureStore``.

The storage account and its credentials come from the environment, as Azure's tools read
them:

- ``AZURE_STORAGE_CONNECTION_STRING`` (what the portal and Azurite hand out): its
  ``AccountName``, ``AccountKey`` or ``SharedAccessSignature``, ``BlobEndpoint`` and
  ``UseDevelopmentStorage=true`` are used (``object_store`` does not read connection
  strings; this module does, and only when ``AZURE_STORAGE_ACCOUNT_NAME`` is not set);
- else ``object_store``'s own chain: ``AZURE_STORAGE_ACCOUNT_NAME`` with
  ``AZURE_STORAGE_ACCOUNT_KEY``, a SAS (``AZURE_STORAGE_SAS_KEY``), a service principal
  (``AZURE_CLIENT_ID`` / ``AZURE_CLIENT_SECRET`` / ``AZURE_TENANT_ID``), workload identity
  (``AZURE_FEDERATED_TOKEN_FILE``, as AKS sets it), or the managed identity of the VM/pod.

Azurite, the emulator, is reached with its connection string, or with
``AZURE_STORAGE_USE_EMULATOR=true`` (its well-known account and key; the endpoint
``http://127.0.0.1:10000`` unless ``AZURITE_BLOB_STORAGE_URL`` says otherwise).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from obstore.store import AzureStore

from batchd_server.storage.cloud import Cloud

__all__ = ["Azure", "connection_settings"]

_CONTAINER: Final = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")


def connection_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """``AzureStore`` settings from ``AZURE_STORAGE_CONNECTION_STRING`` (empty when it is
    not set, or when ``AZURE_STORAGE_ACCOUNT_NAME`` is: explicit variables win)."""
    text = env.get("AZURE_STORAGE_CONNECTION_STRING") or ""
    if not text.strip() or env.get("AZURE_STORAGE_ACCOUNT_NAME"):
        return {}
    parts: dict[str, str] = {}
    for item in text.split(";"):
        name, sep, value = item.partition("=")
        if sep:
            parts[name.strip().lower()] = value.strip()
    out: dict[str, Any] = {}
    if parts.get("usedevelopmentstorage", "").lower() == "true":
        out["use_emulator"] = True
    if parts.get("accountname"):
        out["account_name"] = parts["accountname"]
    if parts.get("accountkey"):
        out["access_key"] = parts["accountkey"]
    if parts.get("sharedaccesssignature"):
        out["sas_key"] = parts["sharedaccesssignature"].lstrip("?")
    if parts.get("blobendpoint"):
        out["endpoint"] = parts["blobendpoint"].rstrip("/")
    return out


class Azure(Cloud):
    scheme = "az"
    bucket_noun = "container"
    env_prefixes = ("AZURE_", "AZURITE_")
    credentials_hint = (
        "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_NAME with an account key or "
        "SAS, or the managed/workload identity"
    )
    endpoint_hint = "the connection string's BlobEndpoint, or AZURE_STORAGE_ENDPOINT"

    def bucket_problem(self, name: str) -> str | None:
        if _CONTAINER.fullmatch(name) and "--" not in name:
            return None
        return (
            "3 to 63 lowercase letters, digits and single hyphens, starting and ending with a "
            "letter or digit"
        )

    def endpoint(self, env: Mapping[str, str]) -> str | None:
        found = connection_settings(env).get("endpoint")
        if found is None and (env.get("AZURE_STORAGE_USE_EMULATOR") or "").lower() == "true":
            found = env.get("AZURITE_BLOB_STORAGE_URL") or "http://127.0.0.1:10000"
        return found or env.get("AZURE_STORAGE_ENDPOINT") or env.get("AZURE_ENDPOINT") or None

    def make(self, bucket: str, env: Mapping[str, str], options: dict[str, Any]) -> AzureStore:
        extra = connection_settings(env)
        endpoint = self.endpoint(env) or ""
        if endpoint.startswith("http://"):
            options["client_options"] = options["client_options"] | {"allow_http": True}
        return AzureStore(bucket, **options, **extra)

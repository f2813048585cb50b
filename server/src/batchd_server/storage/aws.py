"""Amazon S3 and S3-compatible stores (``s3://BUCKET/PREFIX``) through obstore's ``S3Store``.

``object_store`` reads the standard AWS configuration itself: ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_REGION``,
the pod's web identity (``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``, as EKS sets
them), ECS and EKS Pod Identity container credentials, and the instance metadata service.

What ``object_store`` does not read, this module adds (:func:`store_config`):

- **Profiles** (``AWS_PROFILE``, ``~/.aws/credentials`` and ``~/.aws/config``, or the files
  that ``AWS_SHARED_CREDENTIALS_FILE`` / ``AWS_CONFIG_FILE`` name): used when the
  environment holds no keys and no web identity. A profile's static keys, ``region`` and
  ``endpoint_url`` are read here; a profile without keys (SSO, ``role_arn``) goes through
  boto3 when it is installed (it is not a dependency).
- **Plain HTTP endpoints**: an ``http://`` endpoint (a MinIO or SeaweedFS on a private
  network) works (``object_store`` would refuse it unless ``AWS_ALLOW_HTTP`` is set).
"""

from __future__ import annotations

import configparser
import os
import re
from collections.abc import Mapping
from typing import Any, Final

from obstore.store import S3Store

from batchd_server.storage.cloud import IP_ADDRESS, Cloud

__all__ = ["S3", "store_config"]

_BUCKET: Final = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
"""S3's rule for bucket names: 3 to 63 lowercase letters, digits, dots and hyphens,
starting and ending with a letter or digit (no two dots in a row, not an IP address)."""
_PROFILE_KEYS: Final = (
    ("aws_access_key_id", "access_key_id"),
    ("aws_secret_access_key", "secret_access_key"),
    ("aws_session_token", "token"),
)


def _profile_sections(name: str, env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The ``[name]`` section of the shared credentials file and ``[profile name]`` (or
    ``[default]``) of the config file; empty where absent."""
    home = os.path.expanduser("~")
    creds_file = env.get("AWS_SHARED_CREDENTIALS_FILE") or f"{home}/.aws/credentials"
    config_file = env.get("AWS_CONFIG_FILE") or f"{home}/.aws/config"
    found = []
    for file, section in (
        (creds_file, name),
        (config_file, name if name == "default" else f"profile {name}"),
    ):
        parser = configparser.RawConfigParser()
        try:
            parser.read(file, encoding="utf-8")
        except (configparser.Error, UnicodeDecodeError):
            parser = configparser.RawConfigParser()
        found.append(dict(parser[section]) if parser.has_section(section) else {})
    return found[0], found[1]


def store_config(environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], Any]:
    """What the environment leaves out of ``object_store``'s own chain (see the module
    docs): extra ``S3Store`` settings, and a credential provider (or None).

    The environment itself is read by ``object_store`` (``S3Store`` reads ``AWS_*`` on
    construction); only a profile's settings and ``allow_http`` are returned here.
    """
    env = os.environ if environ is None else environ
    extra: dict[str, Any] = {}
    provider = None
    chain_has_keys = any(
        env.get(k)
        for k in (
            "AWS_ACCESS_KEY_ID",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        )
    )
    creds, config = _profile_sections(env.get("AWS_PROFILE") or "default", env)
    if not env.get("AWS_REGION") and not env.get("AWS_DEFAULT_REGION") and config.get("region"):
        extra["region"] = config["region"]
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if not endpoint and config.get("endpoint_url"):
        endpoint = extra["endpoint"] = config["endpoint_url"]
    if not chain_has_keys:
        merged = config | creds
        static = {ours: merged[theirs] for theirs, ours in _PROFILE_KEYS if merged.get(theirs)}
        if "access_key_id" in static and "secret_access_key" in static:
            extra.update(static)
        elif env.get("AWS_PROFILE"):
            provider = _boto3_provider(env["AWS_PROFILE"])
    if endpoint and endpoint.startswith("http://"):
        extra["allow_http"] = True
    return extra, provider


def _boto3_provider(profile: str) -> Any:
    """A profile without static keys (SSO, an assumed role), through boto3 if it is here."""
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None  # object_store's own chain then decides (and says what is missing)
    try:
        return Boto3CredentialProvider(boto3.Session(profile_name=profile))
    except Exception:  # no such profile: object_store's chain then says what is missing
        return None


class S3(Cloud):
    scheme = "s3"
    env_prefixes = ("AWS_",)
    credentials_hint = "AWS_* environment, profile or web identity"
    endpoint_hint = "AWS_ENDPOINT_URL"

    def bucket_problem(self, name: str) -> str | None:
        if _BUCKET.fullmatch(name) and ".." not in name and not IP_ADDRESS.fullmatch(name):
            return None
        return (
            "3 to 63 lowercase letters, digits, dots and hyphens, starting and ending with a "
            "letter or digit, not an IP address"
        )

    def endpoint(self, env: Mapping[str, str]) -> str | None:
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if endpoint:
            return endpoint
        _, config = _profile_sections(env.get("AWS_PROFILE") or "default", env)
        return config.get("endpoint_url") or None

    def make(self, bucket: str, env: Mapping[str, str], options: dict[str, Any]) -> S3Store:
        extra, provider = store_config(env)
        return S3Store(bucket, credential_provider=provider, **options, **extra)

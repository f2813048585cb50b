"""What one object store is to batchd: its URL scheme, its bucket-name rule, how its client
is made from the environment, and what an error message tells an operator to check.

Each store is a :class:`Cloud` of its own module (``aws.py``, ``gcs.py``, ``azure.py``);
``clouds.py`` keeps the table of them, keyed by scheme. The reading code above
(``s3.py``'s fetcher, listings, session-open checks) never asks which store it is.

Credentials stay inside the client objects that :meth:`Cloud.make` returns: a Cloud never
logs, returns or stores one. :meth:`Cloud.endpoint` may be logged (it is the operator's
log), and is never put in a message that reaches tenants.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar, Final

__all__ = ["IP_ADDRESS", "Cloud"]

IP_ADDRESS: Final = re.compile(r"\d+\.\d+\.\d+\.\d+")


class Cloud:
    """One object store's rules. Subclasses set the class attributes and implement
    :meth:`bucket_problem`, :meth:`endpoint` and :meth:`make`."""

    scheme: ClassVar[str]
    """The URL scheme without ``://``: ``s3``, ``gs``, ``az``."""
    bucket_noun: ClassVar[str] = "bucket"
    """What the store calls the first part of a URL (Azure: container)."""
    env_prefixes: ClassVar[tuple[str, ...]]
    """Environment variables starting with one of these configure the client: a process
    whose variables change gets a client made anew."""
    credentials_hint: ClassVar[str]
    """Where the server's credentials for this store come from, for error messages."""
    endpoint_hint: ClassVar[str]
    """The variable that points the server at another endpoint (an emulator, a gateway)."""

    def bucket_problem(self, name: str) -> str | None:
        """Why ``name`` is not a valid bucket (container) name of this store, or None."""
        raise NotImplementedError

    def endpoint(self, env: Mapping[str, str]) -> str | None:
        """The endpoint the environment points the client at, None for the cloud's own."""
        raise NotImplementedError

    def make(self, bucket: str, env: Mapping[str, str], options: dict[str, Any]) -> Any:
        """A client of ``bucket`` configured from ``env`` and the shared ``options``
        (``retry_config`` and ``client_options``, which this may extend)."""
        raise NotImplementedError

"""The decode cache's server settings (``docs/server/decode-cache.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchd_server.settings import at_least, path, setting_of, size

__all__ = ["DecodeCacheSettings"]


@dataclass(frozen=True, kw_only=True)
class DecodeCacheSettings:
    """The decode cache's settings."""

    decode_cache_bytes: int = size(
        flag="--decode-cache-size",
        default=0,
        check=at_least(0),
        help="keep decoded samples in shared memory, up to this many bytes taken from "
        "--shm-budget, e.g. 8GiB, so later epochs skip reading and decoding them "
        "(a random crop still crops each epoch); 0: no decode cache",
    )

    decode_cache_dir: Path | None = path(
        flag="--decode-cache-dir",
        help="a directory on a local disk for the decode cache's second tier, which takes "
        "what shared memory has no room for and keeps it across restarts; only the "
        "server's user may write it, and one server at a time uses it (it is locked); "
        "needs --decode-cache-size",
        metavar="DIR",
    )

    decode_cache_dir_bytes: int = size(
        flag="--decode-cache-dir-size",
        default=0,
        check=at_least(0),
        help="the most bytes the decode cache keeps in --decode-cache-dir",
        default_text="4 times --decode-cache-size",
    )

    def check_decode_cache(self) -> None:
        """Raises ValueError when the settings do not go together."""
        if self.decode_cache_dir is not None and not self.decode_cache_bytes:
            cache = setting_of(DecodeCacheSettings, "decode_cache_bytes")
            directory = setting_of(DecodeCacheSettings, "decode_cache_dir")
            raise ValueError(
                f"{directory.flag} ({directory.env}) is the decode cache's second tier; set "
                f"{cache.flag} ({cache.env}) too, to turn the cache on"
            )

"""The decode cache's server settings, declared as :class:`ServerConfig`'s are (its base).

``ServerConfig`` inherits these fields, so the command line, the environment loader and the
settings page list them like every other setting (``batchd_server/config.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from batchd_server.settings import at_least, parse_bytes, setting, setting_of

__all__ = ["DecodeCacheSettings"]


@dataclass(frozen=True, kw_only=True)
class DecodeCacheSettings:
    """The decode cache's settings (``docs/server/decode-cache.md``)."""

    decode_cache_bytes: int = field(
        default=0,
        metadata=setting(
            "keep decoded samples in shared memory, up to this many bytes taken from "
            "--shm-budget, e.g. 8GiB, so later epochs skip reading and decoding them "
            "(a random crop still crops each epoch); 0: no decode cache",
            flag="--decode-cache-size",
            env="BATCHD_DECODE_CACHE_SIZE",
            parse=parse_bytes,
            check=at_least(0),
            metavar="BYTES",
        ),
    )
    decode_cache_dir: Path | None = field(
        default=None,
        metadata=setting(
            "a directory on a local disk for the decode cache's second tier, which takes "
            "what shared memory has no room for and keeps it across restarts (one server "
            "per directory); needs --decode-cache-size",
            flag="--decode-cache-dir",
            env="BATCHD_DECODE_CACHE_DIR",
            parse=Path,
            metavar="DIR",
        ),
    )
    decode_cache_dir_bytes: int = field(
        default=0,
        metadata=setting(
            "the most bytes the decode cache keeps in --decode-cache-dir",
            flag="--decode-cache-dir-size",
            env="BATCHD_DECODE_CACHE_DIR_SIZE",
            parse=parse_bytes,
            check=at_least(0),
            metavar="BYTES",
            default_text="4 times --decode-cache-size",
        ),
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

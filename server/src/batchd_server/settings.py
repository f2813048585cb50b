"""A setting declared once: the field of a feature's settings dataclass carries its flag,
environment variable, help, parser and check (a :class:`Setting` in the field's metadata),
and everything else is derived from that one declaration: the argparse arguments
(:func:`add_arguments`, :func:`given`), the environment loader (:func:`from_environ`), the
per-value checks (:func:`check_values`) and the reference table (:func:`markdown_table`).

Every feature declares its settings the same way, beside its code: a frozen, keyword-only
dataclass whose fields are made by :func:`setting` (or one of its kinds: :func:`seconds`,
:func:`count`, :func:`size`, :func:`path`, :func:`switch`)::

    @dataclass(frozen=True, kw_only=True)
    class ShmSettings:
        shm_dir: Path = path("where shared-memory segments live", default=Path("/dev/shm"),
                             flag="--shm-dir", metavar="DIR")

``config.py`` composes them: ``ServerConfig`` inherits every feature's dataclass. The
declaration lives on the field, not in a table the dataclass is built from, so each
dataclass stays a plain frozen dataclass that mypy and readers see field by field: the type
and the default where they always are, the setting's words next to them.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "EVERY_COMMAND",
    "Check",
    "Setting",
    "add_arguments",
    "at_least",
    "check_values",
    "count",
    "declared",
    "format_size",
    "from_environ",
    "given",
    "host_port",
    "markdown_table",
    "one_of",
    "parse_bool",
    "parse_bytes",
    "path",
    "seconds",
    "setting",
    "setting_of",
    "size",
    "split_host_port",
    "switch",
    "where",
    "within",
]

EVERY_COMMAND = "*"
"""In :attr:`Setting.commands`: the flag works with every command, before or after it."""

_UNITS = {
    "": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "ki": 1 << 10,
    "mib": 1 << 20,
    "mi": 1 << 20,
    "gib": 1 << 30,
    "gi": 1 << 30,
    "tib": 1 << 40,
    "ti": 1 << 40,
}
_BYTES_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")
_HOST_PORT_HINT = "write e.g. 127.0.0.1:9400, 0.0.0.0:9400 or [::]:9400"
_KEY = "batchd.setting"


# -- parsers ----------------------------------------------------------------------------------


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"512MiB"``, ``"1g"``, ``"1.5GB"`` → bytes (SI and binary units).

    Raises:
        ValueError: the text is not a size.
    """
    match = _BYTES_RE.fullmatch(text)
    unit = match[2].lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size in bytes; write e.g. 1073741824, 512MiB or 2GiB")
    return int(float(match[1]) * _UNITS[unit])


def format_size(n: int) -> str:
    """Bytes as :func:`parse_bytes` reads them back: ``1GiB``, ``56MiB``, or ``1000``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case).

    Raises:
        ValueError: anything else.
    """
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not a boolean; write 1 or 0")


def split_host_port(text: str, what: str = "address") -> tuple[str, int]:
    """``"0.0.0.0:9400"`` -> ``("0.0.0.0", 9400)``; ``"[::1]:9400"`` -> ``("::1", 9400)``.

    Raises:
        ValueError: ``text`` is not HOST:PORT with a port in 0..65535.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{what}={text!r} is not HOST:PORT; {_HOST_PORT_HINT}")
    return host.removeprefix("[").removesuffix("]"), int(port)


# -- checks -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """A rule one value must meet (None, an unset optional setting, is never checked)."""

    rule: str
    """What a valid value is, for the reference table: ``>= 1``, ``(0, 86400]``."""
    problem: Callable[[Any], str | None]
    """What is wrong with a value (``must be >= 1``), or None when nothing is."""


def at_least(low: float, *, why: str = "", size: bool = False) -> Check:
    """``value >= low``; ``why`` follows the rule in the error (``: one for ...``); ``size``
    writes ``low`` as bytes (``1MiB``)."""
    rule = f">= {format_size(int(low)) if size else f'{low:g}'}"
    return Check(rule, lambda v: None if v >= low else f"must be {rule}{why}")


def within(low: float, high: float, *, low_open: bool = False, note: str = "") -> Check:
    """``low <= value <= high`` (``low < value`` with ``low_open``); ``note`` follows the
    interval in the table and the error (``, 0 for none``)."""
    rule = f"{'(' if low_open else '['}{low:g}, {high:g}]{note}"

    def problem(v: float) -> str | None:
        ok = (low < v if low_open else low <= v) and v <= high
        return None if ok else f"must be in {rule}"

    return Check(rule, problem)


def one_of(choices: Sequence[str]) -> Check:
    """``value in choices``."""
    rule = ", ".join(choices)
    return Check(rule, lambda v: None if v in choices else f"must be one of {rule}")


def _host_port_problem(value: str) -> str | None:
    try:
        split_host_port(value)
    except ValueError:
        return f"is not HOST:PORT; {_HOST_PORT_HINT}"
    return None


host_port = Check("HOST:PORT", _host_port_problem)
"""``value`` is ``HOST:PORT`` with a port in 0..65535."""


# -- the declaration --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Setting:
    """How one config field is set, checked and explained (see :func:`setting`)."""

    help: str
    """What the setting does, for ``--help`` and the reference table; never its default,
    which is appended from the field."""
    flag: str | None = None
    """The command-line flag (``--shm-budget``), or None for none."""
    env: str | None = None
    """The environment variable (``BATCHD_SHM_BUDGET``), or None for none."""
    parse: Callable[[str], Any] = str
    """A flag's argument or the variable's text -> the value; raises ValueError."""
    check: Check | None = None
    metavar: str | None = None
    default_text: str | None = None
    """How the default reads where it is no plain value (a factory, or None meaning more
    than "none"); otherwise the field's default is shown."""
    default_in: Callable[[Mapping[str, str]], Any] | None = None
    """The default given the environment, where it depends on other variables."""
    many: str | None = None
    """The value is a tuple: the variable separates items with this, the flag repeats."""
    commands: tuple[str, ...] = ("serve",)
    """The subcommands that take the flag (:data:`EVERY_COMMAND`: all of them)."""
    secret: bool = False
    """Never show the value in a message (a URL may hold a password)."""

    def where(self) -> str:
        """``--flag, BATCHD_VAR``: how an operator sets it, for error messages."""
        return ", ".join(s for s in (self.flag, self.env) if s)

    def parse_env(self, text: str) -> Any:
        """The variable's text -> the value (items split on :attr:`many`)."""
        if self.many is None:
            return self.parse(text)
        return tuple(self.parse(item) for item in text.split(self.many) if item)


def _env_of(flag: str) -> str:
    """The variable a flag's setting reads unless it names another: ``--shm-budget`` ->
    ``BATCHD_SHM_BUDGET``."""
    return "BATCHD_" + flag.removeprefix("--").upper().replace("-", "_")


def setting(
    help: str,
    *,
    default: Any = dataclasses.MISSING,
    default_factory: Callable[[], Any] | None = None,
    flag: str | None = None,
    env: str | None = None,
    **declared: Any,
) -> Any:
    """A field of a feature's settings dataclass that is a setting:
    ``listen: str = setting("where to serve gRPC", default="127.0.0.1:50051", flag="--listen")``.

    The variable is the flag's (``--listen``: ``BATCHD_LISTEN``) unless ``env`` names
    another; a setting with no flag names its variable. ``declared`` are the rest of the
    :class:`Setting`'s fields (``parse``, ``check``, ``metavar``, ...), given to it as they
    are, so a new field of the declaration is one line there. :func:`seconds`,
    :func:`count`, :func:`size`, :func:`path` and :func:`switch` are this for the usual
    kinds of value."""
    assert flag is not None or env is not None, f"{help!r}: a setting needs a flag or a variable"
    declaration = Setting(
        help=help,
        flag=flag,
        env=env if env is not None or flag is None else _env_of(flag),
        **declared,
    )
    metadata = {_KEY: declaration}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def seconds(help: str, *, default: float, check: Check, **more: Any) -> Any:
    """A :func:`setting` of a duration in seconds (``--grace-s S``)."""
    return setting(help, default=default, parse=float, check=check, metavar="S", **more)


def count(help: str, *, default: int | None, check: Check | None = None, **more: Any) -> Any:
    """A :func:`setting` of a whole number (``--max-sessions N``), at least 1 unless ``check``
    says otherwise."""
    check = at_least(1) if check is None else check
    more.setdefault("metavar", "N")
    return setting(help, default=default, parse=int, check=check, **more)


def size(help: str, *, default: int | None, check: Check, **more: Any) -> Any:
    """A :func:`setting` of a size in bytes (``--shm-budget BYTES``: ``2GiB``, ``512MiB``)."""
    return setting(help, default=default, parse=parse_bytes, check=check, metavar="BYTES", **more)


def path(help: str, *, metavar: str, **more: Any) -> Any:
    """A :func:`setting` of a filesystem path (``--tls-cert PEM``); unset by default."""
    more.setdefault("default", None)
    return setting(help, parse=Path, metavar=metavar, **more)


def switch(help: str, **more: Any) -> Any:
    """A :func:`setting` that is off unless given (``--insecure``, ``BATCHD_INSECURE=1``)."""
    return setting(help, default=False, parse=parse_bool, **more)


def declared(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Setting]]:
    """Each field of dataclass ``cls`` that is a setting, in declaration order."""
    for f in dataclasses.fields(cls):
        if _KEY in f.metadata:
            yield f, f.metadata[_KEY]


def setting_of(cls: type, name: str) -> Setting:
    """The setting of field ``name`` of ``cls``."""
    found = next((s for f, s in declared(cls) if f.name == name), None)
    assert found is not None, f"{cls.__name__}.{name} is not a setting"
    return found


def where(cls: type, name: str) -> str:
    """``--flag, BATCHD_VAR`` of field ``name`` of ``cls``."""
    return setting_of(cls, name).where()


def _show(value: Any, s: Setting) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and s.parse is parse_bytes:
        return format_size(value)
    if isinstance(value, tuple):
        return repr([str(v) for v in value])
    if isinstance(value, Path):
        return repr(str(value))
    return repr(value) if isinstance(value, str) else str(value)


def default_text(f: dataclasses.Field[Any], s: Setting) -> str:
    """The field's default as the help and the table say it."""
    if s.default_text is not None:
        return s.default_text
    assert f.default is not dataclasses.MISSING, f"{f.name}: a factory default needs words"
    if f.default is None:
        return "none"
    if isinstance(f.default, str | Path):
        return str(f.default)
    return _show(f.default, s)


def check_values(config: Any) -> None:
    """Check each set value of dataclass instance ``config`` against its setting's rule.

    Raises:
        ValueError: ``name=value must be ... (--flag, BATCHD_VAR)``, for the first that fails.
    """
    for f, s in declared(type(config)):
        value = getattr(config, f.name)
        if s.check is None or value is None:
            continue
        problem = s.check.problem(value)
        if problem is not None:
            subject = f.name if s.secret else f"{f.name}={_show(value, s)}"
            raise ValueError(f"{subject} {problem} ({s.where()})")


def from_environ(cls: type, environ: Mapping[str, str]) -> dict[str, Any]:
    """The values ``environ`` sets for ``cls``'s settings (an empty variable is unset).

    Raises:
        ValueError: a variable does not parse; the message names it.
    """
    values: dict[str, Any] = {}
    for f, s in declared(cls):
        text = environ.get(s.env) if s.env else None
        if text:
            try:
                values[f.name] = s.parse_env(text)
            except ValueError as e:
                shown = "..." if s.secret else repr(text)
                raise ValueError(f"{s.env}={shown} is not valid: {e}") from e
        elif s.default_in is not None:
            values[f.name] = s.default_in(environ)
    return values


# -- the command line -------------------------------------------------------------------------


def _argument_type(name: str, s: Setting) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = s.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
        problem = None if s.check is None or s.many else s.check.problem(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{text} {problem}")
        return value

    convert.__name__ = name
    return convert


def help_text(f: dataclasses.Field[Any], s: Setting) -> str:
    """``--help``'s line: the help, then the default and the variable."""
    tail = f"default: {default_text(f, s)}"
    if s.env:
        tail += f"; ${s.env}"
    return f"{s.help} ({tail})".replace("%", "%%")


def add_arguments(
    parser: argparse.ArgumentParser, cls: type, command: str, *, default: Any = None
) -> None:
    """Add a flag for each setting of ``cls`` that ``command`` takes. An absent flag leaves
    ``default`` (None, or ``argparse.SUPPRESS`` for no attribute) so :func:`given` skips it."""
    for f, s in declared(cls):
        if s.flag is None or command not in s.commands:
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text(f, s)}
        if s.parse is parse_bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = _argument_type(f.name, s)
            kwargs["metavar"] = s.metavar
            if s.many is not None:
                kwargs["action"] = "append"
        parser.add_argument(s.flag, **kwargs)


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The settings of ``cls`` that flags set in ``args`` (repeated flags as a tuple)."""
    values = {}
    for f, s in declared(cls):
        value = getattr(args, f.name, None)
        if s.flag is not None and value is not None:
            values[f.name] = tuple(value) if s.many is not None else value
    return values


# -- the reference ----------------------------------------------------------------------------


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown_table(cls: type) -> str:
    """One row per setting of ``cls``: its field, flag (and the commands that take it),
    variable, default, allowed values and what it does."""
    rows = [
        "| Field | Flag | Environment variable | Default | Allowed | What it sets |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for f, s in declared(cls):
        flag = "" if s.flag is None else f"`{s.flag}`"
        if s.flag is not None and s.commands != ("serve",):
            scope = ", ".join("every command" if c == EVERY_COMMAND else c for c in s.commands)
            flag += f" ({scope})"
        if s.flag is not None and s.many is not None:
            flag += ", repeatable"
        env = "" if s.env is None else f"`{s.env}`"
        if s.env is not None and s.many is not None:
            env += f" (`{s.many}`-separated)"
        allowed = "" if s.check is None else s.check.rule
        cells = (f"`{f.name}`", flag, env, default_text(f, s), allowed, s.help)
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows) + "\n"

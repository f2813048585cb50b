"""Rule 4 of the layout (``test_layout.py``): only ``batchd_server.shm`` creates, reserves or
unlinks a segment or another file in /dev/shm, checked on the source of both distributions
by following what each call's path expression may be (:func:`segment_operations`), and run
over a tree with a breach of each kind so that a checker that can no longer fail is noticed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

from import_graph import REPO, SOURCE_ROOTS, module_names, under


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


SHM_HOME = "batchd_server.shm"
_SHM_WORDS = ("shm", "segment")
_ALWAYS = {
    "posix_fallocate": "reserves a segment's pages",
    "shm_open": "creates a segment",
    "shm_unlink": "unlinks a segment",
    "SharedMemory": "makes a segment that the resource tracker may unlink",
    "ShareableList": "makes a segment that the resource tracker may unlink",
}
"""Calls that touch shared memory whatever their arguments. ``SharedMemory`` counts even
without ``create=True``: on Python 3.11 attaching registers the name with the resource
tracker, which unlinks it when the attaching process exits."""
_CREATES = ("touch", "write_bytes", "write_text")


def _tags(expr: ast.AST, tainted: dict[str, set[str]]) -> set[str]:
    """What ``expr`` may be: "shm" (a path in /dev/shm or of a segment), "creat" (flags with
    O_CREAT). A name or attribute tells by its spelling or by what was assigned to it."""
    tags: set[str] = set()
    for node in ast.walk(expr):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "/dev/shm" in node.value:
                tags.add("shm")
        elif isinstance(node, ast.Name | ast.Attribute):
            spelled = node.id if isinstance(node, ast.Name) else node.attr
            if any(word in spelled.lower() for word in _SHM_WORDS):
                tags.add("shm")
            if spelled == "O_CREAT":
                tags.add("creat")
            tags |= tainted.get(ast.unparse(node), set())
    return tags


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``scope``, not descending into nested functions and classes."""
    for child in ast.iter_child_nodes(scope):
        yield child
        if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield from _own_nodes(child)


def _assignments(node: ast.AST) -> list[tuple[ast.expr, ast.expr]]:
    if isinstance(node, ast.Assign):
        return [(target, node.value) for target in node.targets]
    if isinstance(node, ast.AnnAssign | ast.AugAssign) and node.value is not None:
        return [(node.target, node.value)]
    if isinstance(node, ast.NamedExpr):
        return [(node.target, node.value)]
    if isinstance(node, ast.For | ast.AsyncFor):
        return [(node.target, node.iter)]
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [(node.optional_vars, node.context_expr)]
    return []


def _taint(scope: ast.AST, inherited: dict[str, set[str]]) -> dict[str, set[str]]:
    """``inherited`` plus what assignments in ``scope`` tag, to a fixed point."""
    tainted = {key: set(tags) for key, tags in inherited.items()}
    pairs = [pair for node in _own_nodes(scope) for pair in _assignments(node)]
    changed = True
    while changed:
        changed = False
        for target, value in pairs:
            tags = _tags(value, tainted)
            elements = target.elts if isinstance(target, ast.Tuple | ast.List) else [target]
            for element in elements:
                key = ast.unparse(element)
                if not tags <= tainted.get(key, set()):
                    tainted[key] = tainted.get(key, set()) | tags
                    changed = True
    return tainted


def _operation(call: ast.Call, tainted: dict[str, set[str]]) -> str | None:
    """What ``call`` does to a segment, or None if it creates and unlinks none."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    on = ast.unparse(func.value) if isinstance(func, ast.Attribute) else None
    args = call.args
    if name in _ALWAYS:
        return _ALWAYS[name]
    first_shm = bool(args) and "shm" in _tags(args[0], tainted)
    if name == "open" and on == "os" and len(args) >= 2 and first_shm:
        return "creates a file in /dev/shm" if "creat" in _tags(args[1], tainted) else None
    if name == "open" and on is None and first_shm:
        modes = [*args[1:2], *(k.value for k in call.keywords if k.arg == "mode")]
        mode = modes[0] if modes else None
        if isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wxa"):
            return "creates a file in /dev/shm"
        return None
    if name in ("unlink", "remove", "rmtree") and on in ("os", "shutil") and first_shm:
        return "unlinks a file in /dev/shm"
    on_shm_path = (
        isinstance(func, ast.Attribute)
        and on not in ("os", "shutil")
        and "shm" in _tags(func.value, tainted)
    )
    if on_shm_path and name == "unlink":
        return "unlinks a file in /dev/shm"
    if on_shm_path and name in _CREATES:
        return "creates a file in /dev/shm"
    return None


def segment_operations(path: Path) -> list[tuple[int, str, str]]:
    """``(line, call, what it does)`` for each call in ``path`` that creates or unlinks a
    segment or another file in /dev/shm (see ``_operation``).

    A path counts as one in /dev/shm when its expression says so: a name or attribute
    spelled with "shm" or "segment", "/dev/shm", or a variable (``self.<attribute>`` across
    a class's methods) assigned from such an expression. A path handed to a helper under a
    neutral parameter name is not followed into the helper.
    """
    found: list[tuple[int, str, str]] = []

    def scan(scope: ast.AST, inherited: dict[str, set[str]]) -> None:
        tainted = _taint(scope, inherited)
        for node in _own_nodes(scope):
            if isinstance(node, ast.Call) and (what := _operation(node, tainted)):
                written = ast.get_source_segment(source, node) or ast.unparse(node)
                found.append((node.lineno, " ".join(written.split()), what))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                scan(node, tainted)
            elif isinstance(node, ast.ClassDef):
                scan_class(node, tainted)

    def scan_class(cls: ast.ClassDef, inherited: dict[str, set[str]]) -> None:
        methods = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        shared = dict(inherited)
        while True:  # self.<attribute> tagged in one method is tagged in all of them
            grown = dict(shared)
            for method in methods:
                for key, tags in _taint(method, shared).items():
                    if key.startswith("self."):
                        grown[key] = grown.get(key, set()) | tags
            if grown == shared:
                break
            shared = grown
        scan(cls, shared)

    source = path.read_text()
    scan(ast.parse(source, str(path)), {})
    return sorted(found)


def segment_breaches(roots: Iterable[Path]) -> list[str]:
    """Each call outside batchd_server.shm that creates or unlinks a segment: ``path:line``."""
    found = []
    for root in roots:
        for module, path in module_names(root).items():
            if under(module, SHM_HOME):
                continue
            where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            found += [
                f"{where}:{line}: {call}  ({what})" for line, call, what in segment_operations(path)
            ]
    return found


def test_only_shm_creates_or_unlinks_shared_memory_segments() -> None:
    """Rule 4: no module of either distribution outside batchd_server.shm creates, reserves or
    unlinks a file in /dev/shm (os.open with O_CREAT, posix_fallocate, SharedMemory, unlink)."""
    breaches = segment_breaches(SOURCE_ROOTS)
    assert not breaches, (
        "only batchd_server.shm creates or unlinks segments; ask its ShmRegistry instead:\n"
        + "\n".join(f"  {b}" for b in breaches)
    )


def test_the_segment_check_recognises_how_shm_creates_and_unlinks_segments_today() -> None:
    """The check sees shm/'s own ways: the O_CREAT open of a segment and of the instance
    lock, posix_fallocate, and the sweep's unlinks of segments and lock files."""
    shm = REPO / "server/src/batchd_server/shm"
    seen = {
        (name, call.split("(")[0])
        for name in ("registry.py", "instance.py")
        for _, call, _ in segment_operations(shm / name)
    }
    assert {
        ("registry.py", "os.open"),
        ("registry.py", "os.posix_fallocate"),
        ("instance.py", "os.open"),
        ("instance.py", "os.unlink"),
        ("instance.py", "lock_path.unlink"),
    } <= seen


LEAK = """\
import os
import shutil
from multiprocessing import shared_memory
from pathlib import Path

from batchd_server.shm import SHM_DIR


def make(name, nbytes):
    path = SHM_DIR / name
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
    fd = os.open(path, flags, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    with open(Path("/dev/shm") / name, "wb") as out:
        out.write(b"x")
    return shared_memory.SharedMemory(name=name, create=True, size=nbytes)


def drop(segment, config):
    segment.path.unlink(missing_ok=True)
    os.unlink(config.shm_dir / "batchd-0")
    shutil.rmtree("/dev/shm/batchd")


class Holder:
    def __init__(self, base):
        self.file = base.shm_dir / "batchd-1"

    def close(self):
        self.file.unlink()


def harmless(path, items, shm_dir):
    os.close(os.open(shm_dir / "batchd-2", os.O_RDONLY))
    Path(path).unlink()
    items.remove(3)
    with open(shm_dir / "batchd-3", "rb") as f:
        return f.read()
"""
"""Every way of touching a segment that the check knows, and (``harmless``) what it must let
pass: attaching read-only, unlinking a path outside /dev/shm, ``list.remove``."""


def test_the_segment_check_names_every_breach_in_a_tree_that_has_them(tmp_path: Path) -> None:
    """Outside shm/ each way of creating, reserving or unlinking a segment is reported by
    file:line and call; the same code inside batchd_server.shm is not."""
    _write_tree(tmp_path, {"batchd_server/sessions/leak.py": LEAK, "batchd_server/shm/ok.py": LEAK})
    found = [b.removeprefix(f"{tmp_path}/") for b in segment_breaches([tmp_path])]
    lines = [int(b.split(":")[1]) for b in found]
    assert lines == [12, 13, 14, 16, 20, 21, 22, 30], "\n".join(found)
    assert found[0] == (
        "batchd_server/sessions/leak.py:12: os.open(path, flags, 0o600)  "
        "(creates a file in /dev/shm)"
    )

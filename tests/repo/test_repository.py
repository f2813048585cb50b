"""The repository keeps the promises its README makes about itself."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _quick_start_block() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S)
    assert block, "README's Quick start section has no code block"
    return [ln.split("#", 1)[0].strip() for ln in block.group(1).splitlines() if ln.strip()]


def test_quick_start_is_exactly_two_commands_demo_then_tests() -> None:
    """The first code block under "Quick start" holds two commands: the demo, then the tests."""
    commands = _quick_start_block()
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    for cmd in commands:
        assert (REPO / cmd.split()[1]).is_file(), f"{cmd} names a missing script"


def test_ci_runs_exactly_the_readme_test_command() -> None:
    """.ci/run runs the README's second quick-start command as written: no other command,
    no argument added (only shell options and a cd to the repository root before it)."""
    test_command = _quick_start_block()[1]
    lines = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()]
    commands = [ln for ln in lines if ln and not ln.startswith("#")]
    setup = [c for c in commands if c.startswith("set ") or c == 'cd "$(dirname "$0")/.."']
    runs = [c.removeprefix("exec ") for c in commands if c not in setup]
    assert runs == [test_command], f".ci/run runs {runs}, the README says {test_command!r}"


def _make_recipe(target: str) -> list[str]:
    lines = (REPO / "Makefile").read_text().splitlines()
    assert f"{target}:" in lines, f"the Makefile has no plain {target!r} target"
    recipe = []
    for line in lines[lines.index(f"{target}:") + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_make_demo_and_make_test_are_the_readme_commands() -> None:
    """The README says ``make demo`` and ``make test`` run the same two scripts."""
    demo, test = _quick_start_block()
    assert (_make_recipe("demo"), _make_recipe("test")) == ([demo], [test])


def test_top_level_layout_exists() -> None:
    """The directories DESIGN.md §3 names are all present."""
    for name in ("proto", "server", "client", "deploy", "migrations", "tests", "bench", "examples"):
        assert (REPO / name).is_dir(), name
    assert (REPO / "docker-compose.yml").is_file()
    assert (REPO / "migrations" / "env.py").is_file(), "migrations/ must lead to the Alembic env"


def test_torch_is_pinned_wherever_it_is_named() -> None:
    """Every requirement on torch in the repo pins 2.13.0 (an unpinned torch can pull CUDA)."""
    quoted = re.compile(r"""["']torch\b([^"']*)["']""")  # "torch==2.13.0" in pyproject
    for path in [*REPO.glob("*/pyproject.toml"), *REPO.glob("requirements/*.txt")]:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            specs = [m.group(1) for m in quoted.finditer(line)]
            if path.suffix == ".txt" and re.match(r"torch\b", line):
                specs.append(line[len("torch") :])
            for spec in specs:
                assert spec.replace(" ", "") == "==2.13.0", (
                    f"{path}: {line!r} must pin torch==2.13.0"
                )

"""The documentation keeps its shape: the README is a short front door, the MkDocs site in
docs/ builds in strict mode (no broken link, anchor or nav entry), and no user-facing page
speaks of issue numbers or documents outside the repository, which readers cannot see."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_README_LINES = 250
QUICK_START = ("bash scripts/demo.sh", "bash scripts/test.sh")
SETTINGS_PAGE = "reference/server-settings.md"
"""Generated from the server's configuration declaration; the nav must name it here."""

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_ISSUE_WORD = re.compile(r"\b(?:issues?|PRs?|pull requests?)[\s-]*#?\d+", re.I)
_HASH_NUMBER = re.compile(r"(?<![\w&/#(])#\d+(?![\w-])")
_OUTSIDE_DOCS = re.compile(r"\.\./shared/|\b(?:DESIGN|STYLE)\.md\b|perf-baselines")
_MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


class _MkdocsYaml(yaml.SafeLoader):
    """``yaml.safe_load`` plus the ``!!python/name:`` tags mkdocs.yml uses to name a Markdown
    extension's hook (the Mermaid fence), read as their dotted names; nothing is imported."""


_MkdocsYaml.add_multi_constructor(
    "tag:yaml.org,2002:python/name:", lambda _loader, suffix, _node: suffix
)


def _mkdocs_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=_MkdocsYaml)
    return config


def _user_docs() -> list[Path]:
    return [README, *sorted((REPO / "docs").rglob("*.md"))]


def _prose(markdown: str) -> str:
    """The text of a page without its code: fenced blocks and inline code spans removed."""
    return _INLINE_CODE.sub(" ", _FENCE.sub(" ", markdown))


def _issue_references(markdown: str) -> list[str]:
    """Issue or pull-request numbers in a page's prose: "issue 14", "issue-14", "#14"."""
    prose = _prose(markdown)
    named = _ISSUE_WORD.findall(prose)
    return named + _HASH_NUMBER.findall(_ISSUE_WORD.sub(" ", prose))


def test_the_docs_site_builds_in_strict_mode_without_a_warning(tmp_path: Path) -> None:
    """``mkdocs build --strict`` succeeds and logs no warning (links, anchors, nav)."""
    assert importlib.util.find_spec("material"), (
        "mkdocs-material is not installed: pip install -r requirements/test.txt"
    )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner, not a finding
    site = tmp_path / "site"
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    warnings = [ln for ln in output.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", ln)]
    assert not warnings, "mkdocs warned:\n" + "\n".join(warnings)
    assert (site / "reference" / "server-settings" / "index.html").is_file()


def test_mkdocs_config_is_strict_and_turns_every_broken_reference_into_a_warning() -> None:
    """mkdocs.yml sets strict mode and ``warn`` for every link and nav check, and its nav
    names the generated settings page at its fixed path."""
    config = _mkdocs_config()
    assert config["strict"] is True
    validation = config["validation"]
    assert validation["nav"] == dict.fromkeys(
        ("omitted_files", "not_found", "absolute_links"), "warn"
    )
    assert validation["links"] == dict.fromkeys(
        ("not_found", "absolute_links", "unrecognized_links", "anchors"), "warn"
    )
    assert SETTINGS_PAGE in yaml.safe_dump(config["nav"])
    assert (REPO / "docs" / SETTINGS_PAGE).is_file()


def test_readme_is_a_front_door_of_at_most_250_lines() -> None:
    """The README stays short; the detail lives in docs/."""
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines, more than {MAX_README_LINES}: move detail into docs/"
    )


def test_readme_holds_both_quick_start_commands() -> None:
    """The README names the demo and the test command exactly as CI runs them."""
    text = README.read_text()
    for command in QUICK_START:
        assert command in text, f"README.md lost the quick-start command {command!r}"


def test_readme_links_point_at_files_in_the_repository() -> None:
    """Every relative link of the README names a file or folder that exists in the repo."""
    for target in _MD_LINK.findall(_prose(README.read_text())):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (REPO / target.split("#", 1)[0]).resolve()
        assert path.is_relative_to(REPO), f"README.md links outside the repository: {target}"
        assert path.exists(), f"README.md links to a missing file: {target}"


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("fixed in issue 14, see below", ["issue 14"]),
        ("(issue-14 goal)", ["issue-14"]),
        ("Issues #3 and #12", ["Issues #3", "#12"]),
        ("see #7.", ["#7"]),
        ("`issue 3` in code, [a](#3-steps), &#123;, ## Heading 2", []),
        ("```\n# issue 3\nx = a#1\n```\nplain prose", []),
    ],
)
def test_the_issue_number_check_finds_references_in_prose_only(text: str, found: list[str]) -> None:
    """The check below catches issue numbers in prose and ignores code, anchors, entities."""
    assert _issue_references(text) == found


def test_no_user_facing_doc_names_an_issue_number() -> None:
    """README.md and docs/ speak to readers, who do not know the tracker's issue numbers."""
    offenders = {
        str(path.relative_to(REPO)): refs
        for path in _user_docs()
        if (refs := _issue_references(path.read_text()))
    }
    assert not offenders, f"say the fact instead of the issue number: {offenders}"


def test_no_user_facing_doc_cites_a_document_outside_the_repository() -> None:
    """Docs state facts themselves rather than point at design notes readers do not have."""
    offenders = {
        str(path.relative_to(REPO)): sorted(set(_OUTSIDE_DOCS.findall(path.read_text())))
        for path in _user_docs()
        if _OUTSIDE_DOCS.search(path.read_text())
    }
    assert not offenders, f"cite only what the repository holds: {offenders}"


_FENCE_LINE = re.compile(r"^(```|~~~)\s*(\S*)")
_ASCII_PICTURE_LINE = re.compile(r"^\s*[+|].*-{3,}.*[+|]\s*$|-{3,}>|<-{3,}|[─│┌┐└┘▶▼]", re.M)


def _plain_fences(markdown: str) -> list[str]:
    """The bodies of a page's fenced blocks with no language or ``text``: where a picture
    drawn in characters would be."""
    bodies: list[str] = []
    body: list[str] | None = None
    plain = False
    for line in markdown.splitlines():
        fence = _FENCE_LINE.match(line)
        if body is None:
            if fence:
                body, plain = [], fence[2] in ("", "text")
        elif fence and not fence[2]:
            if plain:
                bodies.append("\n".join(body))
            body = None
        else:
            body.append(line)
    return bodies


def _ascii_pictures(markdown: str) -> list[str]:
    """The first line of each plain or ``text`` fence in a page that draws boxes or arrows."""
    return [
        body.splitlines()[0] for body in _plain_fences(markdown) if _ASCII_PICTURE_LINE.search(body)
    ]


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("```\n a\n+-----+\n| box |\n+-----+\n```\n", [" a"]),
        ("```text\nclient --- batch ---> server\n```\n", ["client --- batch ---> server"]),
        ("```\nLoader ── gRPC ──▶ api/\n```\n", ["Loader ── gRPC ──▶ api/"]),
        ("```bash\necho '--->'\n```\n", []),
        ("```mermaid\nflowchart LR\n  a --> b\n```\n", []),
        ("```\n.venv/bin/python bench/chaos.py --quick   # 15 s each\n```\n", []),
        ("| a | b |\n| --- | --- |\n", []),
    ],
)
def test_the_ascii_picture_check_finds_boxes_and_arrows_in_plain_fences_only(
    text: str, found: list[str]
) -> None:
    """The check below finds drawn boxes and arrows in plain fences, not in code or tables."""
    assert _ascii_pictures(text) == found


def test_no_user_facing_doc_draws_a_picture_in_ascii() -> None:
    """Pictures are Mermaid diagrams, which the site and GitHub draw to the reader's width;
    a picture drawn in characters is cut off on a laptop's screen."""
    offenders = {
        str(path.relative_to(REPO)): pictures
        for path in _user_docs()
        if (pictures := _ascii_pictures(path.read_text()))
    }
    assert not offenders, f"draw these as ```mermaid diagrams: {offenders}"


def test_mermaid_fences_are_drawn_by_the_site() -> None:
    """Every page with a ```mermaid block is built with superfences' mermaid fence, which
    Material turns into a diagram (without it the block shows as code)."""
    pages = [path for path in _user_docs() if re.search(r"^```mermaid\s*$", path.read_text(), re.M)]
    assert pages, "no page has a Mermaid diagram; the home page's picture should be one"
    extensions = _mkdocs_config()["markdown_extensions"]
    fences = next(
        ext["pymdownx.superfences"]["custom_fences"]
        for ext in extensions
        if isinstance(ext, dict) and "pymdownx.superfences" in ext
    )
    assert {
        "name": "mermaid",
        "class": "mermaid",
        "format": "pymdownx.superfences.fence_code_format",
    } in fences


def _bench_plots() -> Any:
    spec = importlib.util.spec_from_file_location("bench_plots", REPO / "bench" / "plots.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)  # matplotlib is imported only when a chart is drawn
    return module


def test_every_benchmark_chart_is_drawn_by_its_bench_from_saved_results() -> None:
    """Each chart the Benchmarks page shows is a bench's: the bench records its output, its
    results are saved in bench/results/, and bench/plots.py has a chart for it whose tables
    are in those results, so ``python bench/plots.py`` can redraw every one."""
    charts = re.findall(r"\]\(img/bench/(\w+)\.png\)", (REPO / "docs/benchmarks.md").read_text())
    assert len(charts) >= 10, "the Benchmarks page lost its charts"
    plots = _bench_plots()
    for name in charts:
        assert (REPO / f"docs/img/bench/{name}.png").is_file(), f"{name}.png was never drawn"
        assert name in plots.PLOTTERS, f"bench/plots.py has no chart for {name}"
        script = (REPO / f"bench/{name}.py").read_text()
        assert f'recorded("{name}")' in script, f"bench/{name}.py does not record its results"
        saved = REPO / f"bench/results/{name}.md"
        assert saved.is_file(), f"bench/results/{name}.md is missing: the chart cannot be redrawn"
        assert plots.tables(saved.read_text()), f"bench/results/{name}.md holds no table"

"""Every file the README, docs/ and the benchmark records name exists, and the records stay small."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO_ROOT

TOP_DIRS = ("commlib", "backends", "ddp", "benchmarks", "docs", "tests", "scripts", "examples")
PAGES = [
    REPO_ROOT / "README.md",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
    *sorted((REPO_ROOT / "benchmarks" / "results").rglob("*.md")),
]
SOURCES = [
    path
    for top in ("commlib", "backends", "ddp", "benchmarks", "scripts", "examples", "tests")
    for path in sorted((REPO_ROOT / top).rglob("*"))
    if path.suffix in (".py", ".sh") and ".venv" not in path.parts
]
PLACEHOLDER = re.compile(r"[<>{}$]|NAME|\bN\b")
"""A path to fill in (``<date>``, ``NAME``, ``{a,b}``, ``$OUT``), not one that must exist."""
REPO_PATH = re.compile(rf"(?<![\w/.-])(?:{'|'.join(TOP_DIRS)})/[\w./*-]*[\w*/]")
"""A path from the repository's root (not the tail of another path, such as ``/tmp/docs/x``)."""
SUFFIXES = (".py", ".md", ".sh", ".csv", ".txt")


def _names_a_file(path: str) -> bool:
    """A file or folder of the repository (a suffix, a trailing ``/``, a glob), not a placeholder or a key."""
    return path.endswith((*SUFFIXES, "/", "*")) and not PLACEHOLDER.search(path)


def _exists(path: str, base: Path = REPO_ROOT) -> bool:
    path = path.split("::")[0].rstrip(".")
    if "*" in path:
        return any(base.glob(path))
    return (base / path).exists()


def _missing_in_page(page: Path) -> list[str]:
    text = page.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):  # markdown links, relative to the page
        path = target.split("#")[0]
        if path and not re.match(r"[a-z]+://", target) and not (page.parent / path).exists():
            missing.append(f"link {target}")
    for code in re.findall(r"`([^`\n]+)`", text):
        missing += [path for path in REPO_PATH.findall(code) if _names_a_file(path) and not _exists(path)]
    return missing


def test_every_path_the_pages_name_exists() -> None:
    missing = [
        f"{page.relative_to(REPO_ROOT)}: {what}" for page in PAGES for what in _missing_in_page(page)
    ]
    assert not missing, "\n".join(missing)


def test_every_repository_path_the_code_names_exists() -> None:
    missing = []
    for source in SOURCES:
        for number, line in enumerate(source.read_text().splitlines(), start=1):
            for path in REPO_PATH.findall(line):
                if path.endswith(SUFFIXES) and _names_a_file(path) and not _exists(path):
                    missing.append(f"{source.relative_to(REPO_ROOT)}:{number}: {path}")
    assert not missing, "\n".join(missing)


def test_the_benchmark_records_are_one_undated_folder_per_benchmark_under_1_mb() -> None:
    results = REPO_ROOT / "benchmarks" / "results"
    entries = sorted(p.name for p in results.iterdir())
    dated = [name for name in entries if re.search(r"\d{4}-\d{2}-\d{2}", name)]
    assert not dated, f"dated records (git keeps the history): {dated}"
    assert [n for n in entries if (results / n).is_file()] == ["README.md"], entries
    for folder in (results / n for n in entries if (results / n).is_dir()):
        assert (folder / "summary.md").is_file(), f"{folder.name} has no summary.md"
    size = sum(p.stat().st_size for p in results.rglob("*") if p.is_file())
    assert size < 1 << 20, f"benchmarks/results/ holds {size} bytes"

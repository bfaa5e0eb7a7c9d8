"""The project's files speak of the project (what it does, why, how fast, and the command that shows
it), not of how it was built: no work-session diaries, no references to an issue tracker the repository
does not contain, no machine anecdotes, no dated runs.

Plain file reading, no subprocess: every docs/*.md, README.md, CHANGELOG.md, pyproject.toml, and every
*.py / *.sh / *.toml / *.md file (and extensionless script) under the source, benchmark, example, test,
script and CI folders.

This file is scanned like every other. Its patterns never match their own source: each phrase is
written with ``\\s+`` between its words (and the one hyphenated word is joined from two pieces), so no
phrase appears verbatim here; the samples below are joined the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TREES = ("aiokv", "benchmarks", "examples", "tests", "scripts", ".ci")
SUFFIXES = {".py", ".sh", ".toml", ".md"}
TOP_FILES = ("README.md", "CHANGELOG.md", "pyproject.toml")
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis"}

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\\d+(?:st|nd|rd|th)"
)
# "session" stays legitimate where it names a thing: a Mooncake get session, an HTTP session, pytest's
# scope="session" and its session-scoped fixtures ("the session master"). So only the phrases that
# mean a work session count, and never when "session" goes on to name such a thing.
_NOT_A_THING = r"(?!-scoped|\s+(?:master|fixture|scope|client|start|end)\b)"
_SESSION = r"sessions?(?:'s?)?\b" + _NOT_A_THING

PATTERNS: dict[str, re.Pattern[str]] = {
    "work session": re.compile(
        r"\b(?:this|last|next|other|earlier|previous|later|same|another|helper)\s+" + _SESSION,
        re.IGNORECASE,
    ),
    "numbered session": re.compile(rf"\b(?:{_ORDINALS})\s+" + _SESSION, re.IGNORECASE),
    "session number": re.compile(r"\bsession\s+#?\d+\b", re.IGNORECASE),
    "issue number": re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE),
    "missing document": re.compile(r"\bwrite" + "-up", re.IGNORECASE),
    "machine anecdote": re.compile(
        r"\bquiet\s+machine\b|\bAMX\s+VM\b|\b\d+-core\s+VM\b|\bthis\s+VM\b"
        r"|\bload\s+average\s+(?:of\s+|below\s+|at\s+|~)?\d",
        re.IGNORECASE,
    ),
    "dated run": re.compile(r"\bRun\s+20\d\d-\d\d-\d\d\b", re.IGNORECASE),
}
# "item N" means a tracker's item only next to "issue" (same line or the line before); a numbered list
# item elsewhere is fine.
ITEM = re.compile(r"\bitems?\s+\d+\b", re.IGNORECASE)
NEAR_ITEM = re.compile(r"\bissues?\b", re.IGNORECASE)
# An upstream project's issue is a real reference ("vLLM issue N"), not this repository's tracker.
UPSTREAM = re.compile(
    r"\b(?:vLLM|Mooncake|CPython|Python|NumPy|pytest|uvloop|PyTorch|torch)(?:'s)?\s+$", re.IGNORECASE
)
# A docs heading carrying a date is a diary entry; the figures belong under a heading naming what they show.
DATED_HEADING = re.compile(r"^\s{0,3}#{1,6}\s.*\b20\d\d-\d\d-\d\d\b")


def project_files() -> Iterator[Path]:
    for name in TOP_FILES:
        if (ROOT / name).is_file():
            yield ROOT / name
    yield from sorted((ROOT / "docs").glob("*.md"))
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            if not path.is_file() or SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts):
                continue
            # Extensionless files under .ci/ and scripts/ are scripts (.ci/run).
            scriptish = path.suffix == "" and tree in (".ci", "scripts")
            if path.suffix in SUFFIXES or scriptish:
                yield path


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8", errors="replace").splitlines()


def vocabulary_hits(path: Path, lines: list[str]) -> list[str]:
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    hits = []
    for number, line in enumerate(lines, 1):
        found = []
        for name, pattern in PATTERNS.items():
            for match in pattern.finditer(line):
                if name == "issue number" and UPSTREAM.search(line[: match.start()]):
                    continue
                found.append(f"{name} {match.group(0)!r}")
        previous = lines[number - 2] if number > 1 else ""
        if NEAR_ITEM.search(line) or NEAR_ITEM.search(previous):
            found += [f"issue item {m.group(0)!r}" for m in ITEM.finditer(line)]
        hits += [f"{where}:{number}: {what}" for what in found]
    return hits


def dated_headings(path: Path, lines: list[str]) -> list[str]:
    where = path.relative_to(ROOT)
    inside_code = False
    hits = []
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            inside_code = not inside_code
        elif not inside_code and DATED_HEADING.match(line):
            hits.append(f"{where}:{number}: {line.strip()[:100]}")
    return hits


def _report(hits: list[str], what: str) -> str:
    return f"{len(hits)} {what} (rewrite them to say what the project does and why):\n" + "\n".join(hits)


def test_the_scan_covers_the_project() -> None:
    files = {path.relative_to(ROOT).as_posix() for path in project_files()}
    assert "aiokv/worker.py" in files and "tests/test_project_vocabulary.py" in files
    assert any(name.startswith("docs/") for name in files) or not (ROOT / "docs").is_dir()


def test_no_development_vocabulary() -> None:
    hits = [hit for path in project_files() for hit in vocabulary_hits(path, _lines(path))]
    assert not hits, _report(hits, "lines speak of how the project was built")


def test_no_dated_headings_in_docs() -> None:
    docs = sorted((ROOT / "docs").glob("*.md"))
    hits = [hit for path in docs for hit in dated_headings(path, _lines(path))]
    assert not hits, _report(hits, "docs headings carry a date")


# The samples are joined from words so that this file holds none of the phrases itself.
CAUGHT = [
    " ".join(["measured", "this", "session"]),
    " ".join(["other", "sessions'", "engines"]),
    " ".join(["the", "sixteenth", "session"]),
    " ".join(["helper", "session", "`perf`"]),
    " ".join(["session", "5"]),
    " ".join(["see", "issue", "27"]),
    " ".join(["(issue", "10,", "item", "10)"]),
    " ".join(["the", "write"]) + "-up's scenario",
    " ".join(["on", "a", "quiet", "machine"]),
    " ".join(["an", "Intel", "AMX", "VM"]),
    " ".join(["the", "2-core", "VM"]),
    " ".join(["load", "average", "below", "1"]),
    " ".join(["###", "Run", "2026-12-06", "02:42"]),
]
SPARED = [
    'pytest.fixture(scope="session")',
    "One master for the session; tests that kill or fill a master start their own.",
    "data path against the same session master",
    "a repeated get, a get session and batch_replica_clear",
    "batch_get_session_start, then reads inside that session",
    "an HTTP session per client, reused across requests",
    "the first session-scoped fixture",
    "1. item 3 of a numbered list",
    " ".join(["vLLM", "issue", "12345"]),
    "writeup_prepare_values (the vectorised baseline)",
]


@pytest.mark.parametrize("text", CAUGHT)
def test_the_patterns_catch(text: str) -> None:
    assert vocabulary_hits(Path("sample.md"), [text]), text


@pytest.mark.parametrize("text", SPARED)
def test_the_patterns_spare_legitimate_uses(text: str) -> None:
    assert not vocabulary_hits(Path("sample.md"), [text]), text


def test_dated_headings_are_caught_outside_code_blocks_only() -> None:
    lines = ["## Loop lag at scale", "### After the change (2026-12-03)", "```", "# 2026-12-03 run", "```"]
    assert dated_headings(ROOT / "docs" / "sample.md", lines) == [f"docs/sample.md:2: {lines[1]}"]

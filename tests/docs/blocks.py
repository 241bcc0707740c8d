"""The fenced code blocks of README.md, CHANGELOG.md and docs/, with where they stand and how they are marked.

A shell or Python block either runs in tests/docs (Python blocks run unless marked; a shell block runs when marked
`<!-- run -->`) or carries, on the line right above its fence, `<!-- not-run: REASON -->`, the reason it is not run
here (a GPU, the Hub, minutes of training, a server). tests/docs/test_snippets.py fails on any other block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL = {"bash", "sh", "shell", "console", "zsh"}
PYTHON = {"python", "py", "python3", "pycon"}
MARKER = re.compile(r"^<!--\s*(not-run|run)\s*(?::\s*(.*?))?\s*-->$")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None  # "run", "not-run" or None
    reason: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str | None:
        return "shell" if self.language in SHELL else "python" if self.language in PYTHON else None


def documents() -> list[Path]:
    """Every Markdown file a reader sees: README, the changelog, and the pages under docs/."""
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, language, start = m.group(1), m.group(2).lower(), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        above = lines[start - 1].strip() if start > 0 else ""
        mark = MARKER.match(above)
        found.append(
            Block(
                path,
                start + 1,
                language,
                "\n".join(body) + "\n",
                mark.group(1) if mark else None,
                (mark.group(2) or "").strip() if mark else "",
            )
        )
    return found


def all_blocks() -> list[Block]:
    return [block for path in documents() if path.exists() for block in blocks(path)]

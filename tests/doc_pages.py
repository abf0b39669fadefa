"""The pages a user reads, README.md and every page under docs/: tests that check a documented command read it from
these, so moving a command from one page to another keeps it checked."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def text() -> str:
    """Every page, one after another, with shell line continuations joined (a command is then one line)."""
    return "\n".join(page.read_text() for page in pages()).replace("\\\n", " ")

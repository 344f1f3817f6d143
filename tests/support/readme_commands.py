"""The commands and Python snippets of the README and the docs, as tests/project/test_readme.py runs them.

A command is a line of a ```bash block (backslash-continued lines joined, the comment after ``#``
dropped), or a line of a ```console block that starts with the prompt ``$ `` (the lines after it
are its output); ``make ...``, ``pip install ...`` and ``export ...`` lines are the set-up, not batchfit,
and are left out (``.ci/check_install`` checks the install as a user makes it). A ``VAR=$(batchfit ...)`` line runs its inner command; a leading ``NAME=value`` is an
environment setting of that command. A snippet is a whole ```python block.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = (REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")))  # whose commands and snippets run
SHELL_LANGUAGES = ("bash", "console")  # the fenced blocks whose commands run
PROMPT = "$ "  # a ```console line starting with it is a command, the others its output
SET_UP = ("make ", "pip install ", "export ")  # the README's own set-up lines: not batchfit commands
CAPTURE = re.compile(r"^\w+=\$\((?P<inner>.*)\)\s*(#.*)?$")  # BS=$(batchfit find ... --quiet)
ASSIGNMENT = re.compile(r"^(?P<name>[A-Z_][A-Z0-9_]*)=(?P<value>\S*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, the document and line where it starts, the heading above it."""

    language: str
    document: Path
    line: int
    heading: str
    text: str


@dataclass(frozen=True)
class Command:
    """One documented command: its text as written, its words and the environment it sets."""

    document: Path
    line: int
    text: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.document.name}:{self.line}"


def fenced_blocks(document: Path) -> list[Block]:
    """Every fenced block of ``document`` with its language (``""`` when none is given)."""
    blocks, heading, opened, lines = [], "", None, []
    for number, line in enumerate(document.read_text(encoding="utf-8").splitlines(), start=1):
        if opened is None and line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif opened is None and line.startswith("```"):
            opened, lines = (line[3:].strip(), number), []
        elif opened is not None and line.startswith("```"):
            blocks.append(Block(opened[0], document, opened[1] + 1, heading, "\n".join(lines) + "\n"))
            opened = None
        elif opened is not None:
            lines.append(line)
    return blocks


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """The block's lines with backslash continuations joined, each with the line it starts on."""
    joined, start, parts = [], None, []
    for offset, line in enumerate(block.text.splitlines()):
        start = block.line + offset if start is None else start
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped.strip())
        joined.append((start, " ".join(part for part in parts if part)))
        start, parts = None, []
    return [(number, text) for number, text in joined if text and not text.startswith("#")]


def prompted(block: Block) -> Block:
    """A ```console block reduced to its commands: the prompted lines (and their continuations), the
    prompt dropped; every other line, the output, blank, so the line numbers stay."""
    lines, continued = [], False
    for line in block.text.splitlines():
        if continued or line.startswith(PROMPT):
            lines.append(line if continued else line[len(PROMPT) :])
            continued = line.rstrip().endswith("\\")
        else:
            lines.append("")
    return Block("bash", block.document, block.line, block.heading, "\n".join(lines) + "\n")


def parse_command(document: Path, line: int, text: str) -> Command:
    """A command line as words: a ``$( )`` capture unwrapped, leading ``NAME=value`` taken as env."""
    captured = CAPTURE.match(text)
    words = shlex.split(captured["inner"] if captured else text, comments=True)
    env = {}
    while words and (assignment := ASSIGNMENT.match(words[0])):
        env[assignment["name"]] = assignment["value"]
        words = words[1:]
    return Command(document, line, text, tuple(words), env)


def commands(documents: tuple[Path, ...] = DOCUMENTS) -> list[Command]:
    """Every command of the documents' ```bash and ```console blocks, in order, set-up lines left out."""
    found = []
    for document in documents:
        for block in fenced_blocks(document):
            if block.language not in SHELL_LANGUAGES:
                continue
            for line, text in logical_lines(prompted(block) if block.language == "console" else block):
                if not text.startswith(SET_UP):
                    found.append(parse_command(document, line, text))
    return found


def distinct(found: list[Command]) -> list[Command]:
    """The commands with each one's repeats (the same words and settings, in any document) left
    out: a command runs once, where it is first written."""
    seen, kept = set(), []
    for command in found:
        key = (command.argv, tuple(sorted(command.env.items())))
        if key not in seen:
            seen.add(key)
            kept.append(command)
    return kept


def snippets(documents: tuple[Path, ...] = DOCUMENTS) -> list[Block]:
    """Every ```python block of the documents, in order."""
    return [block for document in documents for block in fenced_blocks(document) if block.language == "python"]

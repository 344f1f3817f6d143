"""A griffe extension for the API reference: fence the doctest examples of batchfit's docstrings.

The docstrings are prose with ``>>>`` examples (run by ``pytest --doctest-modules``), not Google
or NumPy sections. Rendered as Markdown, a ``>>>`` line would become a nested block quote, so each
doctest block (from a ``>>>`` line to the next blank line) is wrapped in a ``pycon`` code fence.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    r"""``text`` with every doctest block wrapped in a ```` ```pycon ```` fence.

    >>> fence_doctests("Prose.\n\n>>> 1 + 1\n2\n\nMore.").splitlines()
    ['Prose.', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'More.']
    """
    lines, out, inside = text.splitlines(), [], False
    for line in lines:
        starts = line.lstrip().startswith(">>>")
        if starts and not inside:
            out.append("```pycon")
            inside = True
        elif inside and not line.strip():
            out.append("```")
            inside = False
        out.append(line)
    if inside:
        out.append("```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fence the doctest blocks of every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)

"""Public names that load on first use (PEP 562), so importing a package costs nothing until a name is read.

``import batchfit`` and the command line's help then load no torch: ``batchfit.SimulatedDevice`` imports its
module the first time it is read. Type checkers and editors see the names through each package's
``if TYPE_CHECKING:`` imports.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any


def lazy_names(package: str, where: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose public names live in the modules ``where`` names.

    >>> getattr_, dir_ = lazy_names("demo", {"sqrt": "math"})
    >>> getattr_("sqrt")(9.0), "sqrt" in dir_()
    (3.0, True)
    >>> getattr_("cbrt")
    Traceback (most recent call last):
    ...
    AttributeError: module 'demo' has no attribute 'cbrt'
    """
    module_now = sys.modules.get(package)  # the package being initialised, when it calls this
    namespace: dict[str, Any] = module_now.__dict__ if module_now is not None else {}

    def getattr_(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # read once: later reads find it in the package itself
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *where})

    return getattr_, dir_

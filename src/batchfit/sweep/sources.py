"""Where a sweep's first guess at each configuration's edge comes from, in the order tried: a model fitted across
the configurations measured so far (``"model"``), the trace on fake tensors (``"trace"``), the user's scaling rules
(``"rules"``). Light to import: the command line's help names them."""

from __future__ import annotations

ESTIMATE_SOURCES = ("model", "trace", "rules")

"""The modules that moved out of the search leave an alias for one release: ``batchfit.search.throughput`` (now the
``batchfit.throughput`` layer) and ``batchfit.search.files`` (now the shared leaf ``batchfit.files``). Each hands on
the very names it held, with a DeprecationWarning that says where they went, and refuses private and unknown names
without a warning."""

from __future__ import annotations

import importlib
import warnings

import pytest

import batchfit.files
import batchfit.throughput
import batchfit.throughput.optimal

MOVED = [
    ("batchfit.search.throughput", "find_optimal_batch_size", batchfit.throughput, "batchfit.throughput"),
    ("batchfit.search.throughput", "optimal_for_workload", batchfit.throughput, "batchfit.throughput"),
    ("batchfit.search.throughput", "check_maximum", batchfit.throughput, "batchfit.throughput"),
    ("batchfit.search.throughput", "ThroughputResult", batchfit.throughput, "batchfit.throughput"),
    ("batchfit.search.throughput", "ThroughputPoint", batchfit.throughput, "batchfit.throughput"),
    ("batchfit.search.throughput", "search_workload", batchfit.throughput.optimal, "batchfit.throughput.optimal"),
    ("batchfit.search.files", "atomic_write_text", batchfit.files, "batchfit.files"),
    ("batchfit.search.files", "atomic_write_bytes", batchfit.files, "batchfit.files"),
    ("batchfit.search.files", "check_writable", batchfit.files, "batchfit.files"),
]


@pytest.mark.parametrize(("old", "name", "new", "home"), MOVED)
def test_the_old_path_warns_and_hands_the_name_on(old, name, new, home):
    alias = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {home}\.{name}$"):
        handed = getattr(alias, name)
    assert handed is getattr(new, name)


def test_the_from_import_form_warns_too():
    with pytest.warns(DeprecationWarning, match="batchfit.throughput.find_optimal_batch_size"):
        from batchfit.search.throughput import find_optimal_batch_size
    assert find_optimal_batch_size is batchfit.throughput.find_optimal_batch_size
    with pytest.warns(DeprecationWarning, match="batchfit.files.atomic_write_text"):
        from batchfit.search.files import atomic_write_text
    assert atomic_write_text is batchfit.files.atomic_write_text


@pytest.mark.parametrize("old", ["batchfit.search.throughput", "batchfit.search.files"])
@pytest.mark.parametrize("name", ["_grid", "_file_mode", "__wrapped__", "no_such_name"])
def test_private_and_unknown_names_are_refused_without_a_warning(old, name):
    alias = importlib.import_module(old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not hasattr(alias, name)

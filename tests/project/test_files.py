"""Files are written atomically: the old file or the whole new one, never half of either."""

from __future__ import annotations

import os

import pytest

from batchfit.files import atomic_write_text


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "result.json"
    target.write_text("old")

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_a_write_replaces_the_whole_file(tmp_path):
    target = tmp_path / "result.json"
    target.write_text("a much longer old content")
    atomic_write_text(target, "new")
    assert target.read_text() == "new"


def test_a_missing_folder_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="does not exist \\(create it first\\)"):
        atomic_write_text(tmp_path / "nope" / "r.json", "x")


def test_new_files_get_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        assert atomic_write_text(tmp_path / "r.json", "x").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)

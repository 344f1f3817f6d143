"""Files are written atomically: the old file or the whole new one, never half of either; what is no regular file
is written as what it is (a symlink through to its target, a device or a FIFO directly) or refused."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from batchfit.errors import InputError
from batchfit.files import atomic_write_bytes
from batchfit.files import atomic_write_text
from batchfit.files import check_writable


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


# What stands at the path decides how it is written: a regular file atomically, a symlink through to its target,
# a device, a FIFO or "-" written through, anything else refused before the work.


def test_a_symlink_to_a_file_writes_the_target_and_stays_a_link(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    target = store / "result.json"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "result.json"
    link.symlink_to(target)
    atomic_write_text(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new" and not target.is_symlink()
    assert target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in store.iterdir()) == ["result.json"]


def test_a_symlink_is_replaced_by_a_temp_file_in_its_targets_folder(tmp_path, monkeypatch):
    store = tmp_path / "store"
    store.mkdir()
    (store / "result.json").write_text("old")
    link = tmp_path / "result.json"
    link.symlink_to("store/result.json")  # relative, as ln -s makes them
    renames = []
    real_replace = os.replace

    def spy(src, dst):
        renames.append((Path(src).parent, Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    atomic_write_text(link, "new")
    assert renames == [(store, store / "result.json")]
    assert link.is_symlink() and (store / "result.json").read_text() == "new"


def test_a_failed_write_through_a_symlink_keeps_both(tmp_path, monkeypatch):
    store = tmp_path / "store"
    store.mkdir()
    (store / "result.json").write_text("old")
    link = tmp_path / "result.json"
    link.symlink_to(store / "result.json")

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(link, "new")
    assert link.is_symlink() and link.read_text() == "old"
    assert sorted(p.name for p in store.iterdir()) == ["result.json"]


def test_a_dangling_symlink_gets_its_target_created(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    link = tmp_path / "result.json"
    link.symlink_to(store / "new.json")
    check_writable(link)
    atomic_write_text(link, "new")
    assert link.is_symlink() and (store / "new.json").read_text() == "new"


def test_a_dangling_symlink_into_a_missing_folder_names_it(tmp_path):
    link = tmp_path / "result.json"
    link.symlink_to(tmp_path / "gone" / "new.json")
    with pytest.raises(InputError, match=f"folder {tmp_path / 'gone'} does not exist"):
        check_writable(link)
    assert link.is_symlink()


def test_a_symlink_loop_is_refused(tmp_path):
    link = tmp_path / "loop.json"
    link.symlink_to(link)
    with pytest.raises(InputError, match="cannot write .*loop.json"):
        check_writable(link)


def test_a_fifo_is_written_through_to_its_reader(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    check_writable(fifo)  # only looks: opening a FIFO would wait for a reader
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    atomic_write_text(fifo, '{"a": 1}\n')
    reader.join(timeout=10)
    assert received == [b'{"a": 1}\n']
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_dev_null_is_writable_and_left_alone():
    before = os.lstat("/dev/null")
    check_writable("/dev/null")  # only the check: the real one is never written here, a copy is below
    after = os.lstat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def null_copy(folder: Path) -> Path:
    """A character device like /dev/null (1, 3) in ``folder``, where mknod is permitted (root), else a skip."""
    path = folder / "null"
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, AttributeError) as error:
        pytest.skip(f"cannot make a character device here ({error})")
    return path


def test_a_character_device_stays_one(tmp_path):
    device = null_copy(tmp_path)
    rdev = os.lstat(device).st_rdev
    link = tmp_path / "via-link"
    link.symlink_to(device)
    atomic_write_text(device, "x" * 10_000)
    atomic_write_bytes(link, b"y")
    assert stat.S_ISCHR(os.lstat(device).st_mode) and os.lstat(device).st_rdev == rdev
    assert link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null", "via-link"]


def test_dash_is_standard_output(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a file named "-" would land
    assert check_writable("-") == Path("-")
    print("before")
    atomic_write_text("-", '{"a": 1}\n')
    assert capsys.readouterr().out == 'before\n{"a": 1}\n'
    assert list(tmp_path.iterdir()) == []


def test_a_folder_is_refused_in_one_line(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    for path in (tmp_path, link):
        with pytest.raises(InputError, match="it is a folder; give a file path such as") as caught:
            atomic_write_text(path, "x")
        assert "\n" not in str(caught.value)
    assert link.is_symlink()


def test_a_socket_is_refused_in_one_line(tmp_path):
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        with pytest.raises(InputError, match="it is a socket; give a regular file path") as caught:
            check_writable(path)
        with pytest.raises(InputError, match="it is a socket"):
            atomic_write_text(path, "x")
        assert "\n" not in str(caught.value)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)

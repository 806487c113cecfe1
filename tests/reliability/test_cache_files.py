"""The compile cache's files: what ``CompileCache.path`` names, and that its sqlite
database is all that stays in its directory once the cache is closed or the process
exits -- no write-ahead log or shared-memory file (``-wal``, ``-shm``) beside it for a
user removing the directory, or a cache made read-only later, to trip on."""

from __future__ import annotations

import gc
import os
import textwrap
import weakref
from pathlib import Path

import pytest

from asyncmetal import CompileCache
from tests.support.children import run_child

ROOT = Path(__file__).resolve().parents[2]
DATABASE = "compile-cache.sqlite"


def test_a_cache_kept_in_memory_names_no_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``path`` is None for a cache without a disk part (``disk=False``, or
    ``$ASYNCMETAL_CACHE`` off), whatever directory it was given; a disk cache's is its
    database, there or not yet. Checked: without the fix a memory-only cache named a
    database in the default cache directory that it never opens."""
    assert CompileCache(tmp_path, disk=False).path is None
    assert CompileCache(disk=False).path is None
    monkeypatch.setenv("ASYNCMETAL_CACHE", "0")
    assert CompileCache(tmp_path).path is None
    monkeypatch.delenv("ASYNCMETAL_CACHE")
    assert CompileCache(tmp_path).path == tmp_path / DATABASE
    assert CompileCache(tmp_path, disk=True).path == tmp_path / DATABASE


def test_a_closed_cache_leaves_only_its_database(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path)
    cache._put_disk("key", b"binary")
    assert cache._load_disk("key") == b"binary"
    cache.close()
    assert sorted(os.listdir(tmp_path)) == [DATABASE]


@pytest.mark.parametrize("close_device", [True, False], ids=["device-closed", "left-open"])
def test_a_process_that_exits_leaves_only_the_database(tmp_path: Path, close_device: bool) -> None:
    """A process that compiled through the shared compile pool (its cache in
    ``$ASYNCMETAL_CACHE_DIR``) and exits, its device closed or not: the cache
    directory holds the database and no ``-wal``/``-shm`` file. Checked: without the
    exit hook closing every cache both were left there."""
    script = textwrap.dedent(
        f"""
        import os, anyio, asyncmetal as am
        async def main():
            dev = await am.open_device("cpu")
            await dev.compile("void k(int* x) {{ x[0] = 1; }}", "k")
            assert os.path.exists(os.path.join(os.environ["ASYNCMETAL_CACHE_DIR"],
                                               "{DATABASE}-wal"))
            if {close_device!r}:
                await dev.close()
        anyio.run(main)
        """
    )
    env = {**os.environ, "ASYNCMETAL_CACHE_DIR": str(tmp_path)}
    env.pop("ASYNCMETAL_CACHE", None)
    child = run_child(script, hung="the child compiling through the pool", timeout=120, env=env)
    assert child.returncode == 0, child.stderr[-4000:]
    left = sorted(name for name in os.listdir(tmp_path) if name.startswith(DATABASE))
    assert left == [DATABASE]


def _no_tracebacks(error: BaseException) -> bool:
    """Whether ``error`` and the errors it chains to hold no traceback."""
    seen, links = set(), [error]
    while links:
        link = links.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        if link.__traceback__ is not None:
            return False
        links += (link.__cause__, link.__context__)
    return True


@pytest.mark.parametrize("why", ["unusable", "read-only"])
def test_why_the_disk_cache_is_off_or_read_only_keeps_no_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """The error a cache keeps to say why its disk part is off (a file where its
    directory should be) or read only (a database it may not write) is kept without
    its traceback (``keep_error``): with it, the frames it was raised through and their
    locals -- the cache itself among them, a reference cycle only the cycle collector
    ends -- would live as long as the cache."""
    if why == "unusable":
        (tmp_path / "file").write_bytes(b"")
        cache = CompileCache(tmp_path / "file")
    else:
        CompileCache(tmp_path)._put_disk("key", b"binary")
        monkeypatch.setattr(CompileCache, "_writable", lambda self: False)
        cache = CompileCache(tmp_path)
    assert cache._load_disk("key") == (None if why == "unusable" else b"binary")
    kept = cache.error if why == "unusable" else cache.read_only
    assert kept is not None and (cache.error is None) == (why == "read-only")
    assert _no_tracebacks(kept)
    cache.close()
    gc.disable()  # (collected by its references going, not by the cycle collector)
    try:
        gone = weakref.ref(cache)
        del cache, kept
        assert gone() is None
    finally:
        gc.enable()

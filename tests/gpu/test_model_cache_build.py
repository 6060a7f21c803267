"""Built-in models are built once into the cache, even when several processes (a TP engine and its
workers) ask for one at the same time: the builders take turns on a lock beside the folder, and a reader
never sees a folder without its files (gpu/models/registry.py `_build_atomically`)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from servetwin.gpu.models import registry


def test_concurrent_builds_build_once_and_never_expose_a_partial_folder(tmp_path):
    dest = tmp_path / "models" / "m"
    calls = []

    def build(tmp: Path) -> None:
        calls.append(tmp)
        (tmp / "weights").write_text("w")
        time.sleep(0.05)  # a slow build: the other threads arrive while it runs
        (tmp / "config.json").write_text("{}")

    def ready() -> bool:
        return (dest / "config.json").exists()

    seen_partial = []

    def builder() -> None:
        if not ready():
            registry._build_atomically(dest, build, ready)
        seen_partial.append(not (dest / "config.json").exists() or not (dest / "weights").exists())

    threads = [threading.Thread(target=builder) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert seen_partial == [False] * 4
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "weights"]
    assert [p.name for p in dest.parent.iterdir() if p.name != ".m.lock"] == ["m"]  # no temp folder left


def test_an_outdated_folder_is_replaced_whole(tmp_path):
    dest = tmp_path / "models" / "m"
    dest.mkdir(parents=True)
    (dest / "stale").write_text("old build")

    def build(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")

    registry._build_atomically(dest, build, lambda: (dest / "config.json").exists())
    assert sorted(p.name for p in dest.iterdir()) == ["config.json"]
    assert [p.name for p in dest.parent.iterdir() if p.name != ".m.lock"] == ["m"]


def test_tiny_model_builds_into_the_cache_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVETWIN_CACHE", str(tmp_path))
    first = registry._ensure_tiny("tiny-llama")
    marker_time = (first / "servetwin_builtin.json").stat().st_mtime_ns
    assert registry._ensure_tiny("tiny-llama") == first
    assert (first / "servetwin_builtin.json").stat().st_mtime_ns == marker_time  # not rebuilt
    assert (first / "config.json").exists()

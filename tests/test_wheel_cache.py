"""The wheel cache shared by processes that fetch at once: the suite's workers, or two commands."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sm120kit import wheels


def test_a_wheel_being_downloaded_is_not_taken_as_cached(tmp_path, monkeypatch):
    """pip copies a downloaded wheel into the cache in place: while one fetch writes it, a
    second fetch of the same release waits for the whole file instead of reading half of it."""
    monkeypatch.setenv(wheels.CACHE_ENV, str(tmp_path))
    calls: list[str] = []
    half_written = threading.Event()

    def slow_pip_download(requirement: str) -> Path:
        calls.append(requirement)
        wheel = tmp_path / "sglang-0.5.23-py3-none-any.whl"
        with wheel.open("wb") as out:
            out.write(b"half")
            out.flush()
            half_written.set()
            time.sleep(0.3)
            out.write(b" and the rest")
        return wheel

    monkeypatch.setattr(wheels, "_pip_download", slow_pip_download)
    first = threading.Thread(target=wheels.fetch, args=("sglang", "0.5.23"))
    first.start()
    assert half_written.wait(5)
    seen = wheels.fetch("sglang", "0.5.23").read_bytes()
    first.join()
    assert seen == b"half and the rest"
    assert calls == ["sglang==0.5.23"]  # the second found it cached once the first was done

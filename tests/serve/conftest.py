"""Fixtures of serve's tests: `sm120kit serve` end to end against the sglang stand-in
(tests/fixtures/sglang_standin.py, a TEST FIXTURE: the real server needs GPUs).

The supervisor runs as its own process, as an operator runs it; real signals, real sockets,
real process trees. The profile renders for a real sglang release (0.5.23 unpacked from its
wheel); the stand-in python runs `-m sglang.launch_server` as the stand-in and everything
else as the interpreter of that environment. What the tests share as code (failure lines,
`ps`, check inputs) is tests/support/serve.py and tests/support/node.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.serve import VERSION
from support.standin import Served, make_env_python


@pytest.fixture(scope="module")
def env_python(tmp_path_factory) -> Path:
    return make_env_python(tmp_path_factory.mktemp("standin-env"), VERSION)


@pytest.fixture
def serve(tmp_path, env_python):
    made: list[Served] = []

    def make(faults: dict | None = None, sets=(), extra=(), env=None) -> Served:
        served = Served(tmp_path, env_python, faults or {}, list(sets), list(extra), env or {})
        made.append(served)
        return served

    yield make
    for served in made:
        served.cleanup()

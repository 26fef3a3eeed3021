"""Where the checkout's things are: its root, and the test fixtures (programs, profiles,
patches) that tests/fixtures holds."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
FIXTURE_PATCHES = FIXTURES / "patches"

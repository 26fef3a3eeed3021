"""Where patches and profiles come from: a user directory that does not exist is named."""

from __future__ import annotations

import pytest

from sm120kit.errors import UserError
from sm120kit.patching.registry import load_patches
from sm120kit.profiles.loader import list_profiles


@pytest.mark.parametrize(
    ("load", "option", "noun"),
    [(load_patches, "--patch-dir", "patch directory"), (list_profiles, "--profile-dir", "profile directory")],
)
def test_a_missing_user_directory_is_named_with_its_option(tmp_path, load, option, noun):
    missing = tmp_path / "nope"
    with pytest.raises(UserError) as info:
        load([str(missing)])
    assert str(info.value).startswith(f"{noun} {missing} does not exist")
    assert option in info.value.hint

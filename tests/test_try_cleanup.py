"""`sm120kit try | head`: the reader goes away while the header is printed, and the scratch
directory still goes (it is removed unless --keep, whatever ends the cycle)."""

from __future__ import annotations

import pytest

from sm120kit import tryout
from sm120kit.cli import main


@pytest.mark.parametrize("lines_before_the_pipe_breaks", [0, 3, 40])
def test_a_reader_gone_mid_output_leaves_no_scratch_dir(tmp_path, lines_before_the_pipe_breaks):
    printed = []

    def echo(line: str) -> None:
        if len(printed) == lines_before_the_pipe_breaks:
            raise BrokenPipeError(32, "Broken pipe")
        printed.append(line)

    with pytest.raises(BrokenPipeError):
        tryout.run(main, parent=tmp_path, echo=echo)
    assert len(printed) == lines_before_the_pipe_breaks
    assert list(tmp_path.iterdir()) == []

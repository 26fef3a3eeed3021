"""The CLI run in-process, as the `cli` fixture hands it to a test: exit code and output."""

from __future__ import annotations

import json

from sm120kit.cli import main


class Cli:
    def __init__(self, capsys):
        self.capsys = capsys

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = self.capsys.readouterr()
        return code, out, err

    def json(self, *argv: str) -> tuple[int, dict]:
        code, out, _ = self(*argv, "--json")
        return code, json.loads(out)

"""Small libcst helpers for patch transforms.

Matchers over a whole 3,000-line module cost half a second; patches know which function
they change, so they find it directly (top level or one class deep) and swap it back in
along the same path.
"""

from __future__ import annotations

from typing import Callable, Iterable

import libcst as cst

Put = Callable[[cst.FunctionDef], cst.Module]


def _spliced(seq, index, new):
    return [*seq[:index], new, *seq[index + 1 :]]


def find_functions(module: cst.Module, names: Iterable[str]) -> list[tuple[cst.FunctionDef, Put]]:
    """Each function or method named in `names`, with a `put(new_function) -> Module`."""
    names = set(names)
    found: list[tuple[cst.FunctionDef, Put]] = []
    for i, stmt in enumerate(module.body):
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value in names:
            found.append((stmt, lambda new, i=i: module.with_changes(body=_spliced(module.body, i, new))))
        elif isinstance(stmt, cst.ClassDef) and isinstance(stmt.body, cst.IndentedBlock):
            for j, inner in enumerate(stmt.body.body):
                if isinstance(inner, cst.FunctionDef) and inner.name.value in names:

                    def put(new, i=i, j=j, cls=stmt):
                        block = cls.body.with_changes(body=_spliced(cls.body.body, j, new))
                        return module.with_changes(body=_spliced(module.body, i, cls.with_changes(body=block)))

                    found.append((inner, put))
    return found


def marker_line(text: str) -> cst.EmptyLine:
    """A comment line to put in front of a changed statement."""
    return cst.EmptyLine(comment=cst.Comment(text))

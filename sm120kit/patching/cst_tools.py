"""libcst for patch transforms: `cst` (libcst itself, imported on first use) and a few
helpers.

Patch modules write `from sm120kit.patching.cst_tools import cst` rather than
`import libcst as cst`: importing libcst costs ~0.4 s, and a `patch --check` whose
verdicts are all cached never needs it.

Walking a whole 3,000-line module costs a large part of a second; patches know which
function they change, so they find it directly (top level or one class deep), search
inside it, and swap it back in along the same path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import libcst


class _Libcst:
    """Stands in for the libcst module until an attribute is first read."""

    def __getattr__(self, name: str) -> Any:
        import libcst

        self.__dict__.update(vars(libcst))
        return getattr(libcst, name)


cst: Any = _Libcst()
Put = Callable[["libcst.FunctionDef"], "libcst.Module"]
_T = TypeVar("_T")


def _spliced(seq: Sequence[_T], index: int, new: _T) -> list[_T]:
    return [*seq[:index], new, *seq[index + 1 :]]


def find_functions(module: libcst.Module, names: Iterable[str]) -> list[tuple[libcst.FunctionDef, Put]]:
    """Each function or method named in `names`, with a `put(new_function) -> Module`."""
    names = set(names)
    found: list[tuple[libcst.FunctionDef, Put]] = []
    for i, stmt in enumerate(module.body):
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value in names:

            def put_top(new: libcst.FunctionDef, i: int = i) -> libcst.Module:
                return module.with_changes(body=_spliced(module.body, i, new))

            found.append((stmt, put_top))
        elif isinstance(stmt, cst.ClassDef) and isinstance(stmt.body, cst.IndentedBlock):
            for j, inner in enumerate(stmt.body.body):
                if isinstance(inner, cst.FunctionDef) and inner.name.value in names:

                    def put(
                        new: libcst.FunctionDef, i: int = i, j: int = j, cls: libcst.ClassDef = stmt
                    ) -> libcst.Module:
                        block = cls.body.with_changes(body=_spliced(cls.body.body, j, new))
                        return module.with_changes(body=_spliced(module.body, i, cls.with_changes(body=block)))

                    found.append((inner, put))
    return found


def iter_nodes(node: libcst.CSTNode) -> Iterator[libcst.CSTNode]:
    """Every node under `node`, itself included (depth first). Cheap on a function;
    libcst.matchers would cost half a second just to import."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(reversed(current.children))


def carries(node: libcst.CSTNode, marker: str) -> bool:
    """Whether a statement has the marker comment `marker` (optionally `marker: why`) in a
    comment line above it; another revision's marker (r1 for r10) does not count."""
    return any(
        line.comment and (line.comment.value == marker or line.comment.value.startswith(marker + ":"))
        for line in getattr(node, "leading_lines", ())
    )


def compares_to(node: libcst.CSTNode, number: str) -> bool:
    """Whether any `x == <number>` appears under `node` (e.g. a capability major 12 branch)."""
    return any(
        isinstance(n, cst.Comparison)
        and any(
            isinstance(t.operator, cst.Equal) and isinstance(t.comparator, cst.Integer) and t.comparator.value == number
            for t in n.comparisons
        )
        for n in iter_nodes(node)
    )


def has_string(node: libcst.CSTNode, value: str) -> bool:
    """Whether a string literal with this value appears under `node`."""
    return any(isinstance(n, cst.SimpleString) and n.evaluated_value == value for n in iter_nodes(node))


def callee_name(call: libcst.Call) -> str | None:
    """`f` for `f(...)` and `x.f(...)`."""
    func = call.func
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return func.value if isinstance(func, cst.Name) else None


def keyword_argument(node: libcst.CSTNode, callee: str, keyword: str) -> libcst.BaseExpression | None:
    """The value passed as `keyword=` to the first call of `callee` under `node`."""
    for n in iter_nodes(node):
        if isinstance(n, cst.Call) and callee_name(n) == callee:
            for arg in n.args:
                if arg.keyword is not None and arg.keyword.value == keyword:
                    return arg.value
    return None


def int_list(node: libcst.CSTNode | None) -> list[int] | None:
    """The integers of a literal list such as `[10, 12]`; None for anything else."""
    if not isinstance(node, cst.List) or not all(isinstance(e.value, cst.Integer) for e in node.elements):
        return None
    return [e.value.evaluated_value for e in node.elements]


def builds_only_for_major(function: libcst.FunctionDef, major: int) -> bool:
    """flashinfer's JIT generators: `get_nvcc_flags_list(supported_major_versions=[major])`
    restricts the module's nvcc targets to that major (e.g. 12: SM12x alone), so a flag
    added to it changes no other GPU's build."""
    return int_list(keyword_argument(function, "get_nvcc_flags_list", "supported_major_versions")) == [major]


def append_element(items: libcst.List, value: libcst.BaseExpression) -> libcst.List:
    """`items` with `value` as a new last element, laid out like the others."""
    elements = list(items.elements)
    last = elements[-1]
    new = cst.Element(value)
    if len(elements) >= 2 and isinstance(last.comma, cst.Comma) and isinstance(elements[-2].comma, cst.Comma):
        # One element per line, trailing comma: the old last takes the inner separator,
        # the new last takes the closing one.
        return items.with_changes(
            elements=[*elements[:-1], last.with_changes(comma=elements[-2].comma), new.with_changes(comma=last.comma)]
        )
    return items.with_changes(
        elements=[*elements[:-1], last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), new]
    )


def insert_after(block: libcst.IndentedBlock, index: int, statement: libcst.BaseStatement) -> libcst.IndentedBlock:
    return block.with_changes(body=[*block.body[: index + 1], statement, *block.body[index + 1 :]])


def marker_line(text: str) -> libcst.EmptyLine:
    """A comment line to put in front of a changed statement."""
    return cst.EmptyLine(comment=cst.Comment(text))

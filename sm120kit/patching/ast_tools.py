"""The cheap read of a target file, for a patch's `quick` reader: the same questions that
cst_tools answers with libcst, asked of `ast` (the module's shape) and of the tokens of the
one function a patch looks at (the comments and string literals that ast drops or merges).

libcst costs ~0.2 s to import and a large part of a second to parse a 3,000-line file; ast
parses it in milliseconds. A quick reader must say what its transform would say, with the
same reason, or nothing: where the cheap read cannot be sure (a marker comment in a place
the transform would judge differently, a value inside an f-string, several statements on
one line) a helper raises Undecided, and the transform decides. tests/test_truth_cheap_reads.py
holds every quick reader to its transform on every release of the window.

Positions: ast counts columns in UTF-8 bytes, tokenize in characters; everything here is
in characters.
"""

from __future__ import annotations

import ast
import io
import itertools
import keyword
import tokenize
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

Function = ast.FunctionDef | ast.AsyncFunctionDef
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
Located = ast.stmt | ast.expr  # a node with a place in the file


class Undecided(Exception):
    """The cheap read cannot tell what the transform would: let it decide."""


@dataclass(frozen=True)
class _Token:
    kind: int
    text: str
    start: tuple[int, int]  # (row, column) in the file
    end: tuple[int, int]


@dataclass
class Code:
    """A target file as ast reads it, with its lines (ends as the parser counts them)."""

    text: str
    tree: ast.Module
    lines: list[str]
    _scopes: dict[int, Scope] = field(default_factory=dict, repr=False)

    @classmethod
    def read(cls, source: bytes) -> Code | None:
        """The file, or None where it is not Python source that ast parses (the transforms
        report those: transform.py's gate)."""
        if b"\0" in source:
            return None
        try:
            encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)
            text = source.decode(encoding)
            with warnings.catch_warnings():  # the vendor's invalid escapes are not ours to show
                warnings.simplefilter("ignore")
                tree = ast.parse(source, "<quick read>")
        except (SyntaxError, UnicodeDecodeError, LookupError, ValueError, RecursionError, MemoryError):
            return None
        text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")  # as the parser counts lines
        return cls(text, tree, _split(text))

    # -- the module's shape (cst_tools.find_functions) -------------------------------------

    def functions(self, names: Iterable[str]) -> list[Function]:
        """Each function or method named in `names`, at the top level or one class deep, in
        the order of the file (cst_tools.find_functions)."""
        names = set(names)
        found: list[Function] = []
        for stmt in self.tree.body:
            if isinstance(stmt, FUNCTIONS) and stmt.name in names:
                found.append(stmt)
            elif isinstance(stmt, ast.ClassDef):
                found += [f for f in stmt.body if isinstance(f, FUNCTIONS) and f.name in names]
        return found

    def classes(self) -> list[ast.ClassDef]:
        return [stmt for stmt in self.tree.body if isinstance(stmt, ast.ClassDef)]

    @cached_property
    def _previous_ends(self) -> dict[int, int]:
        """id of a top-level or class-level statement -> the last row of the code before it
        (the statement before, or its class's header)."""
        ends: dict[int, int] = {}
        blocks: list[tuple[int, list[ast.stmt]]] = [(0, self.tree.body)]
        blocks += [(c.lineno, c.body) for c in self.classes()]
        for header, body in blocks:
            for before, stmt in zip([None, *body], body):
                ends[id(stmt)] = header if before is None else (before.end_lineno or before.lineno)
        return ends

    def scope(self, node: Function | ast.ClassDef) -> Scope:
        """A function's (or class's) tokens and the questions asked of them. A body on the
        `def` line itself (a one-line suite, a different node in libcst) is undecided."""
        if not starts_block(self, node.body):
            raise Undecided(f"{node.name}: the body is on the header's line")
        if id(node) not in self._scopes:
            self._scopes[id(node)] = Scope(self, node)
        return self._scopes[id(node)]

    # -- text ---------------------------------------------------------------------------

    def column(self, row: int, byte_col: int) -> int:
        """ast's byte column on `row` as a character column."""
        line = self.lines[row - 1]
        return byte_col if line.isascii() else len(line.encode()[:byte_col].decode("utf-8", "replace"))

    def span(self, node: Located) -> tuple[tuple[int, int], tuple[int, int]]:
        """(start, end) of a node, decorators included, as (row, character column)."""
        start: Located = node
        if isinstance(node, (*FUNCTIONS, ast.ClassDef)) and node.decorator_list:
            start = node.decorator_list[0]
        end_row, end_col = node.end_lineno or node.lineno, node.end_col_offset or 0
        row, col = start.lineno, self.column(start.lineno, start.col_offset)
        if start is not node:  # the `@` before the first decorator's expression
            col = self.lines[row - 1].rindex("@", 0, col)
        return (row, col), (end_row, self.column(end_row, end_col))

    def source(self, node: Located) -> str:
        """The node's text as written (without parentheses around it)."""
        (row, col), (end_row, end_col) = self.span(node)
        if row == end_row:
            return self.lines[row - 1][col:end_col]
        return "".join([self.lines[row - 1][col:], *self.lines[row : end_row - 1], self.lines[end_row - 1][:end_col]])

    def starts_line(self, node: Located) -> bool:
        """Whether only indentation stands before the node on its first line."""
        (row, col), _ = self.span(node)
        return not self.lines[row - 1][:col].strip()

    def test_is(self, branch: ast.If, text: str) -> bool:
        """Whether an `if`'s test is `text` as libcst's code_for_node writes it (stripped).
        libcst keeps parentheses around the test, ast does not: where the text matches,
        undecided unless only the keyword stands before it and the colon after."""
        if self.source(branch.test).strip() != text.strip() or text.lstrip().startswith("("):
            return False
        (row, col), (end_row, end_col) = self.span(branch.test)
        head = self.lines[row - 1][:col].strip()
        tail = self.lines[end_row - 1][end_col:].lstrip()
        if row != branch.lineno or head not in ("if", "elif") or not tail.startswith(":"):
            raise Undecided("the test is parenthesized or broken over lines")
        return True


def _split(text: str) -> list[str]:
    """Lines ended by "\\n" alone, as the parser counts them (str.splitlines also splits
    on a form feed and other separators)."""
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def starts_block(code: Code, body: list[ast.stmt]) -> bool:
    """Whether a suite is indented on lines of its own (libcst's IndentedBlock), not put
    after the header's colon (a SimpleStatementSuite)."""
    return bool(body) and code.starts_line(body[0])


def blocks(code: Code, node: ast.AST) -> Iterator[list[ast.stmt]]:
    """Every indented suite under `node`, its own included (libcst's IndentedBlock): not a
    suite after the header's colon, and not the `elif` that is an `if`'s orelse in ast."""
    for n in walk(node):
        for name in ("body", "orelse", "finalbody"):
            stmts = getattr(n, name, None)
            if not isinstance(stmts, list) or not stmts or not isinstance(stmts[0], ast.stmt):
                continue
            if name == "orelse" and isinstance(n, ast.If) and _is_elif(code, n):
                continue
            if starts_block(code, stmts):
                yield stmts


def _is_elif(code: Code, branch: ast.If) -> bool:
    if len(branch.orelse) != 1 or not isinstance(branch.orelse[0], ast.If):
        return False
    (row, col), _ = code.span(branch.orelse[0])  # ast starts an elif's If at the keyword
    return code.lines[row - 1][col:].startswith("elif")


def one_per_line(body: list[ast.stmt]) -> None:
    """Statements joined by `;` are one node in libcst (a SimpleStatementLine): undecided."""
    rows = [(s.lineno, s.end_lineno or s.lineno) for s in body]
    if any(a[1] >= b[0] for a, b in itertools.pairwise(rows)):
        raise Undecided("several statements on one line")


def walk(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under `node`, itself included (cst_tools.iter_nodes; the order differs)."""
    return ast.walk(node)


def assigned(stmt: ast.AST, name: str) -> ast.expr | None:
    """The value of `name = value` (one plain name, one target), else None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        [target] = stmt.targets
        if isinstance(target, ast.Name) and target.id == name:
            return stmt.value
    return None


def compared(node: ast.AST, op: type[ast.cmpop]) -> tuple[ast.expr, ast.expr] | None:
    """(left, right) of `left OP right`, one operator of type `op` (libcst: a Comparison with
    one ComparisonTarget), else None."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], op):
        return node.left, node.comparators[0]
    return None


def is_name(node: ast.AST | None, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def callee_name(call: ast.Call) -> str | None:
    """`f` for `f(...)` and `x.f(...)` (cst_tools.callee_name)."""
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def is_integer(code: Code, node: ast.AST | None, text: str) -> bool:
    """An integer literal written `text` (libcst's Integer.value): `12`, not `0xc`, `12.0` or True."""
    return isinstance(node, ast.Constant) and type(node.value) is int and code.source(node) == text


def is_string(code: Code, node: ast.AST | None, value: str) -> bool:
    """A string literal of one part with this value (libcst's SimpleString): not an
    implicitly joined string, not an f-string (a JoinedStr in ast)."""
    if not (isinstance(node, ast.Constant) and type(node.value) is str and node.value == value):
        return False
    text = code.source(node).strip()
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):  # parts on several lines: not one literal
        return False
    return [t.string for t in tokens if t.type == tokenize.STRING] == [text]


def compares_to(code: Code, node: ast.AST, number: str) -> bool:
    """Whether any `x == <number>` appears under `node` (cst_tools.compares_to)."""
    return any(
        isinstance(n, ast.Compare)
        and any(isinstance(op, ast.Eq) and is_integer(code, c, number) for op, c in zip(n.ops, n.comparators))
        for n in walk(node)
    )


def arguments(call: ast.Call) -> list[tuple[str | None, ast.expr]]:
    """(keyword or None, value) of each argument in the order written, as libcst's Call.args
    holds them (`*x` and `**x` give x)."""
    args: list[tuple[tuple[int, int], str | None, ast.expr]] = [
        ((a.lineno, a.col_offset), None, a.value if isinstance(a, ast.Starred) else a) for a in call.args
    ]
    args += [((k.lineno, k.col_offset), k.arg, k.value) for k in call.keywords]
    return [(name, value) for _, name, value in sorted(args, key=lambda a: a[0])]


def keyword_argument(code: Code, node: ast.AST, callee: str, name: str) -> ast.expr | None:
    """The value passed as `name=` to the first call of `callee` under `node`, in the order
    libcst walks (cst_tools.keyword_argument)."""
    calls = [n for n in walk(node) if isinstance(n, ast.Call) and callee_name(n) == callee]
    # depth first in the order written: by start, an outer call before the call it starts with
    calls.sort(key=lambda n: (n.lineno, n.col_offset, -(n.end_lineno or 0), -(n.end_col_offset or 0)))
    for call in calls:
        for keyword_name, value in arguments(call):
            if keyword_name == name:
                return value
    return None


def int_list(node: ast.AST | None) -> list[int] | None:
    """The integers of a literal list such as `[10, 12]` (cst_tools.int_list)."""
    if not isinstance(node, ast.List) or not all(
        isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts
    ):
        return None
    return [e.value for e in node.elts]  # type: ignore[attr-defined]


def builds_only_for_major(code: Code, function: Function, major: int) -> bool:
    """cst_tools.builds_only_for_major."""
    return int_list(keyword_argument(code, function, "get_nvcc_flags_list", "supported_major_versions")) == [major]


class Scope:
    """One function (or class) of a file and its tokens, from the comment lines above it to
    its end: what ast does not keep (comments) or merges (implicitly joined strings)."""

    def __init__(self, code: Code, node: Function | ast.ClassDef) -> None:
        self.code, self.node = code, node
        (row, _), (self.last, _) = code.span(node)
        self.first, bound = row, code._previous_ends.get(id(node), row - 1)
        while self.first - 1 > bound and _blank_or_comment(code.lines[self.first - 2]):
            self.first -= 1  # the comment lines above it (its leading lines, in libcst)

    @cached_property
    def tokens(self) -> list[_Token]:
        text = "".join(self.code.lines[self.first - 1 : self.last])
        shift = self.first - 1
        try:
            return [
                _Token(t.type, t.string, (t.start[0] + shift, t.start[1]), (t.end[0] + shift, t.end[1]))
                for t in tokenize.generate_tokens(io.StringIO(text).readline)
                if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
            ]
        except (tokenize.TokenError, SyntaxError) as exc:  # a region that starts inside a string
            raise Undecided(f"tokens: {exc}") from None

    def _within(self, node: Located) -> list[_Token]:
        start, end = self.code.span(node)
        return [t for t in self.tokens if t.start >= start and t.end <= end]

    # -- string literals (cst_tools.has_string) -------------------------------------------

    def has_string(self, node: Located, value: str) -> bool:
        """Whether a string literal (one part of an implicitly joined string, never an
        f-string: libcst's SimpleString) with this value appears under `node`."""
        for token in self._within(node):
            if token.kind != tokenize.STRING:
                continue
            if _is_fstring(token):
                if value in token.text or not value.isprintable() or "\\" in value:  # a literal in its {...}?
                    raise Undecided(f"an f-string may hold {value!r}")
                continue
            if ast.literal_eval(token.text) == value:
                return True
        return False

    # -- names (libcst's Name: every identifier, attribute names and parameters too) ------

    def has_name(self, node: Located, text: str, *, part: bool = False) -> bool:
        """Whether an identifier equal to `text` (part: containing it) appears under `node`."""
        for token in self._within(node):
            if token.kind == tokenize.NAME and not keyword.iskeyword(token.text):
                if token.text == text or (part and text in token.text):
                    return True
            elif token.kind == tokenize.STRING and text in token.text and _is_fstring(token):
                raise Undecided(f"an f-string may name {text}")
        return False

    # -- marker comments (cst_tools.carries) ----------------------------------------------

    def marked(self, marker: str) -> set[int]:
        """The ids of the statements in the scope (itself included) that carry `marker` in
        the comment lines above them, as libcst's leading_lines hold them. A marker comment
        anywhere else in the scope (after a deeper line that libcst gives the block before,
        above an `else:`, inside brackets) is undecided."""
        if marker not in "".join(self.code.lines[self.first - 1 : self.last]):
            return set()  # the common case: vendor code carries no marker
        statements: dict[int, list[ast.stmt]] = {}
        for n in walk(self.node):
            if isinstance(n, ast.stmt):
                statements.setdefault(self.code.span(n)[0][0], []).append(n)
        marked: set[int] = set()
        for token in self.tokens:
            if token.kind != tokenize.COMMENT or not (token.text == marker or token.text.startswith(marker + ":")):
                continue
            marked.add(id(self._owner(token, statements)))
        return marked

    def _owner(self, comment: _Token, statements: dict[int, list[ast.stmt]]) -> ast.stmt:
        lines = self.code.lines
        row, col = comment.start
        indent = lines[row - 1][:col]
        if indent.strip():
            raise Undecided("a marker after code on its line")
        code_rows = {t.start[0] for t in self.tokens if t.kind != tokenize.COMMENT}
        after = row + 1
        while after <= self.last and after not in code_rows:
            between = lines[after - 1]
            if len(between) - len(between.lstrip(" \t")) > len(indent) and between.strip():
                raise Undecided("a deeper comment line after the marker")  # libcst: the block before's
            if not between.strip() and len(between.rstrip("\n")) > len(indent):
                raise Undecided("a deeper blank line after the marker")
            after += 1
        owners = [s for s in statements.get(after, []) if lines[after - 1][: self.code.span(s)[0][1]] == indent]
        if len(owners) != 1:
            raise Undecided("a marker above no statement")
        return owners[0]


def _is_fstring(token: _Token) -> bool:
    prefix = token.text[: len(token.text) - len(token.text.lstrip("rbuRBUfF"))]
    return "f" in prefix.lower()


def _blank_or_comment(line: str) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("#")

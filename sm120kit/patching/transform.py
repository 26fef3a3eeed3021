"""The pure step: run a file's rewrites over its bytes and judge what each one did.

Bytes in, bytes and findings out; no I/O, no ledger. A file that changes is self-checked
(second pass changes nothing, the marker is present, it compiles): a patch that fails
that is `failed`, whatever its transform said.

Before libcst, the quick reads (quick_verdicts): where every rewrite of a file declares
one and each can tell, the verdicts come from ast and tokens (ast_tools.py) in a few
milliseconds, with no libcst to import (~0.2 s) and no file to parse with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sm120kit.patching.spec import (
    AlreadyApplied,
    AnchorMissing,
    FixedUpstream,
    Outcome,
    Patch,
    QuickResult,
    Rewrite,
    Rewritten,
    TransformResult,
    WouldRewrite,
    marker_revisions,
)


@dataclass
class Finding:
    """What one patch is on one file (or, without a path, on the whole package)."""

    patch: Patch
    outcome: Outcome
    detail: str = ""
    version: str | None = None
    path: str | None = None
    fixed_in: str | None = None  # the upstream release that fixed this part, if any
    unproven: str = ""  # past the proven window: "unproven on sglang 0.5.24 (proven 0.5.9–0.5.23)"
    allowed: bool = False  # an anchor-missing the user accepted (--allow-missing, recorded)
    stuck: bool = False  # outdated, and `patch` cannot rebuild it (the detail says why)
    hint: str = ""  # for an error: what to do next

    @property
    def is_error(self) -> bool:
        return (self.outcome.is_error and not self.allowed) or self.stuck

    def as_json(self) -> dict:
        return {
            "patch": self.patch.id,
            "package": self.patch.package,
            "version": self.version,
            "path": self.path,
            "outcome": self.outcome.value,
            "detail": self.detail,
            "fixed_in": self.fixed_in,
            "proven": not self.unproven,
            "proven_window": self.patch.window,
            "unproven": self.unproven or None,
            "allowed": self.allowed,
            "error": self.is_error,
            "hint": self.hint or None,
            "upstream": list(self.patch.upstream),
        }


def run_rewrites(
    source: bytes, items: list[tuple[Patch, Rewrite]], version: str, relpath: str
) -> tuple[bytes, list[Finding]]:
    """Run each (patch, rewrite) of one file, in order, each on the code the previous one
    left; return the new bytes and one finding per item (would-apply, already-applied,
    fixed-upstream, anchor-missing or failed). `version` is the installed release and
    `relpath` the file's path in the package: both only label the findings. A transform
    that raises or misbehaves is reported as failed, never raised."""
    import libcst as cst

    if (refused := _refused_by_python(source, relpath)) is not None:
        return source, [_finding(p, r, Outcome.ANCHOR_MISSING, refused, version, relpath) for p, r in items]
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        reason = f"{relpath} does not parse ({str(exc).splitlines()[0]})"
        return source, [_finding(p, r, Outcome.ANCHOR_MISSING, reason, version, relpath) for p, r in items]

    findings = []
    rewritten = False  # unchanged code is not generated again: the source is its bytes
    for patch, rewrite in items:
        try:
            result = rewrite.transform(module, patch.context())
        except Exception as exc:  # a patch bug must not take the run down: report it
            import traceback

            detail = f"transform raised {exc!r}\n{traceback.format_exc()}"
            findings.append(_finding(patch, rewrite, Outcome.FAILED, detail, version, relpath))
            continue
        if isinstance(result, Rewritten):
            module, rewritten = result.module, True
        outcome, detail = _judge(result, patch.fixed_in_for(rewrite))
        findings.append(_finding(patch, rewrite, outcome, detail, version, relpath))
    after = module.bytes if rewritten else source
    if after != source:
        _self_check(after, items, findings, relpath)
    return after, findings


def quick_verdicts(
    source: bytes, items: list[tuple[Patch, Rewrite]], version: str, relpath: str
) -> list[Finding] | None:
    """The findings run_rewrites would give, read without libcst, or None where a rewrite
    has no quick read, one cannot tell, or an earlier rewrite of the file would change the
    code the next one reads. A would-apply here is the transform's anchor found; its
    rewrite is computed (and self-checked) only where new bytes are wanted."""
    from sm120kit.patching.ast_tools import Code

    code = Code.read(source) if items and all(rewrite.quick for _, rewrite in items) else None
    if code is None:  # no quick read, or not Python that ast parses (the transforms' gate says why)
        return None
    findings = []
    for n, (patch, rewrite) in enumerate(items, 1):
        try:
            result = rewrite.quick(code, patch.context()) if rewrite.quick else None
        except Exception:  # ast_tools.Undecided, or a quick reader's bug: the transform decides
            return None
        if result is None or (isinstance(result, WouldRewrite) and n < len(items)):
            return None
        outcome, detail = _judge(result, patch.fixed_in_for(rewrite))
        findings.append(_finding(patch, rewrite, outcome, detail, version, relpath))
    return findings


# libcst's native parser recurses once per level of an expression on the thread's stack: a
# file nested a few thousand deep (brackets, a chain of 5000 lambdas) kills the process by
# SIGSEGV. CPython's parser bounds nesting (200 brackets, 100 indents, its recursion limit),
# well below that; a file it cannot parse for another reason (syntax newer than this Python)
# reaches libcst only with every logical line under these bounds.
MAX_BRACKETS = 200
MAX_LINE_TOKENS = 2000


def _refused_by_python(source: bytes, relpath: str) -> str | None:
    """Why `source` must not be given to libcst, or None: NUL bytes (a binary file), bytes
    that are not text in the file's encoding (UTF-8 unless it declares another), nesting
    past CPython's limits (or, where CPython cannot parse it, past MAX_BRACKETS or
    MAX_LINE_TOKENS). Such a file is the code of no release: its patches find nothing
    they know in it."""
    import ast
    import io
    import tokenize

    if b"\0" in source:
        return f"{relpath} holds NUL bytes: not Python source (a binary file?)"
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)
        text = source.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        return f"{relpath} is not Python source text ({exc})"
    nested = f"{relpath} is nested deeper than Python's parser allows: not the code of any release"
    try:
        compile(source, relpath, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
        return None
    except SyntaxError as exc:
        if "too many" in str(exc.msg) or "too complex" in str(exc.msg):  # nested parentheses, indents, blocks
            return nested
        invalid = f"{relpath} does not parse ({exc.msg} at line {exc.lineno})"
    except (ValueError, RecursionError, MemoryError):
        return nested
    try:
        return None if _bounded(text) else nested
    except (SyntaxError, tokenize.TokenError):
        return invalid


def _bounded(text: str) -> bool:
    """Whether every logical line stays within MAX_BRACKETS and MAX_LINE_TOKENS."""
    import io
    import tokenize

    level = count = 0
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        count = 0 if token.type == tokenize.NEWLINE else count + 1
        if token.type == tokenize.OP and token.string in "([{":
            level += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            level -= 1
        if level > MAX_BRACKETS or count > MAX_LINE_TOKENS:
            return False
    return True


def _finding(patch: Patch, rewrite: Rewrite, outcome: Outcome, detail: str, version: str, relpath: str) -> Finding:
    return Finding(patch, outcome, detail, version, relpath, patch.fixed_in_for(rewrite))


def _judge(result: TransformResult | QuickResult, fixed_in: str | None) -> tuple[Outcome, str]:
    """A transform's (or a quick read's) result value as (outcome, detail)."""
    if isinstance(result, Rewritten | WouldRewrite):
        return Outcome.WOULD_APPLY, ""
    if isinstance(result, AlreadyApplied):
        return Outcome.ALREADY_APPLIED, ""
    if isinstance(result, FixedUpstream):
        return Outcome.FIXED_UPSTREAM, f"fixed upstream in {fixed_in}: {result.reason}" if fixed_in else result.reason
    if isinstance(result, AnchorMissing):
        return Outcome.ANCHOR_MISSING, result.reason
    return Outcome.FAILED, f"transform returned {result!r}"


def _self_check(after: bytes, items: list[tuple[Patch, Rewrite]], findings: list[Finding], relpath: str) -> None:
    """Black's assert_stable, for patches: the result parses, compiles, carries each
    marker, and a second pass of every transform that rewrote it changes nothing. A
    would-apply that fails this becomes failed (the findings are judged in place)."""
    import libcst as cst

    text = after.decode("utf-8", "replace")
    try:
        compile(after, relpath, "exec", dont_inherit=True)
        module = cst.parse_module(after)
    except (SyntaxError, ValueError, cst.ParserSyntaxError) as exc:
        for f in findings:
            if f.outcome is Outcome.WOULD_APPLY:
                f.outcome, f.detail = Outcome.FAILED, f"the rewritten file does not compile: {exc}"
        return
    for (patch, rewrite), f in zip(items, findings):
        if f.outcome is not Outcome.WOULD_APPLY:
            continue
        if patch.revision not in marker_revisions(text, patch.id):
            f.outcome, f.detail = Outcome.FAILED, "the transform did not leave its marker comment"
        elif not isinstance(rewrite.transform(module, patch.context()), AlreadyApplied):
            f.outcome, f.detail = Outcome.FAILED, "unstable: a second pass would change the code again"

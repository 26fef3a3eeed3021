"""The shape of the code: module sizes and the largest functions (issue 13's proof).

python scripts/code_shape.py                # this checkout
python scripts/code_shape.py --rev HEAD~3   # another commit (read through git)
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sources(rev: str | None) -> dict[str, str]:
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "sm120kit").rglob("*.py"))}
    names = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, "sm120kit"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return {
        n: subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{n}"], check=True, capture_output=True, text=True
        ).stdout
        for n in names
        if n.endswith(".py")
    }


def functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node.end_lineno - node.lineno + 1
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield f"{prefix}{node.name}", None
            yield from functions(node, f"{prefix}{node.name}.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision to measure instead of the working tree")
    parser.add_argument("--top", type=int, default=15, help="how many modules and functions to list")
    args = parser.parse_args()
    files = sources(args.rev)
    sizes = sorted(((len(text.splitlines()), name) for name, text in files.items()), reverse=True)
    funcs = []
    classes = []
    for name, text in files.items():
        tree = ast.parse(text)
        for qual, length in functions(tree):
            if length is not None:
                funcs.append((length, f"{name}:{qual}"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{name}:{node.name}"))
    total = sum(n for n, _ in sizes)
    print(f"{len(sizes)} modules, {total} lines; largest modules:")
    for n, name in sizes[: args.top]:
        print(f"  {n:5d}  {name}")
    print("largest functions:")
    for n, name in sorted(funcs, reverse=True)[: args.top]:
        print(f"  {n:5d}  {name}")
    print("largest classes:")
    for n, name in sorted(classes, reverse=True)[:5]:
        print(f"  {n:5d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

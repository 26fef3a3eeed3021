"""`patches`, `status`, `patch`, `unpatch`: the patch engine's commands."""

from __future__ import annotations

import sys

from sm120kit.cli.args import (
    allow_missing_arg,
    allowed_missing,
    common_args,
    load_target_and_patches,
    patch_args,
    target_args,
)


def register(sub) -> None:
    """patches, status, patch, unpatch."""
    p = sub.add_parser("patches", help="list the known patches: id, releases, upstream fix")
    p.add_argument("--patch-dir", action="append", metavar="DIR", help="also list patches from DIR")
    common_args(p)
    p.set_defaults(func=cmd_patches)

    p = sub.add_parser("status", help="one row per patch: installed version, outcome, upstream fix")
    target_args(p)
    patch_args(p)
    allow_missing_arg(p)
    common_args(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("patch", help="apply the patches that the installed releases need")
    target_args(p)
    patch_args(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="write nothing; exit 1 if anything would change")
    mode.add_argument("--diff", action="store_true", help="write nothing; print the unified diff that would be written")
    mode.add_argument("--verify", action="store_true", help="apply, then prove from disk that every patch is in place")
    p.add_argument("--force", action="store_true", help="patch files that someone else edited")
    allow_missing_arg(p)
    p.add_argument(
        "--keep-jit-cache", action="store_true", help="keep JIT caches (flashinfer) built from the old sources"
    )
    common_args(p)
    p.set_defaults(func=cmd_patch)

    p = sub.add_parser("unpatch", help="restore the vendor's bytes, proven against the wheel's RECORD")
    target_args(p)
    patch_args(p)
    p.add_argument("--dry-run", action="store_true", help="say what would be restored, write nothing")
    p.add_argument("--force", action="store_true", help="restore the originals even over later edits")
    p.add_argument(
        "--keep-jit-cache", action="store_true", help="keep JIT caches (flashinfer) built from the patched sources"
    )
    common_args(p)
    p.set_defaults(func=cmd_unpatch)


def cmd_patches(args) -> int:
    from sm120kit import report
    from sm120kit.patching.registry import load_patches, shipped_dir

    text, docs = report.patch_listing(load_patches(args.patch_dir), str(shipped_dir()))
    report.emit_json({"patches": docs}) if args.json else print(text)
    return 0


def cmd_status(args) -> int:
    from sm120kit import report
    from sm120kit.patching import engine

    target, patches = load_target_and_patches(args)
    plan = engine.plan(target, patches, need_bytes=False, allow_missing=allowed_missing(args))
    code = plan.exit_code(check=True)
    if args.json:
        report.emit_json(report.plan_json("status", plan, code))
        return code
    report.print_plan(plan, args.debug)
    return code


def cmd_patch(args) -> int:
    from sm120kit import report
    from sm120kit.patching import engine

    target, patches = load_target_and_patches(args)
    if args.check or args.diff:
        plan = engine.plan(target, patches, force=args.force, need_bytes=args.diff, allow_missing=allowed_missing(args))
        code = plan.exit_code(check=args.check)
        diffs = [c.diff() for c in plan.changes] if args.diff else []
        if args.json:
            report.emit_json(
                report.plan_json("patch", plan, code, {"mode": "diff" if args.diff else "check", "diffs": diffs})
            )
            return code
        if args.diff:
            sys.stdout.write("".join(diffs))
            for f in plan.errors:
                print(f"error: {f.patch.id}: {f.outcome.value}: {f.detail}", file=sys.stderr)
            return code
    else:
        plan = engine.apply(
            target, patches, force=args.force, keep_jit_cache=args.keep_jit_cache, allow_missing=allowed_missing(args)
        )
        code = plan.exit_code(check=False)
    problems = engine.verify(target, patches) if args.verify and code == 0 else []
    if problems:
        code = 2
    if args.json:
        mode = "verify" if args.verify else "check" if args.check else "apply"
        report.emit_json(
            report.plan_json(
                "patch",
                plan,
                code,
                {"mode": mode, "verify_problems": problems, "verified": bool(args.verify and code == 0)},
            )
        )
        return code
    report.print_plan(plan, args.debug)
    print(report.summary(plan.findings) + ("" if not plan.errors else "; nothing was written"))
    if args.check and code == 1:
        print("would change: run `sm120kit patch` to apply")
    if args.verify:
        if problems:
            print("verify FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        elif code == 0:
            caveat = "; unproven on this release: see above" if plan.unproven else ""
            print(
                f"verified: every patch is in place, fixed upstream or not applicable, and matches the ledger{caveat}"
            )
    return code


def cmd_unpatch(args) -> int:
    from sm120kit import report
    from sm120kit.patching import engine

    target, patches = load_target_and_patches(args, selected=False)
    only = set(args.only) if args.only else None
    result = engine.unpatch(
        target, patches, only, force=args.force, dry_run=args.dry_run, keep_jit_cache=args.keep_jit_cache
    )
    rows = result.rows
    code = 2 if any(r.is_error for r in rows) else 0
    if args.json:
        report.emit_json(
            {
                "command": "unpatch",
                "target": target.as_json(),
                "results": [r.as_json() for r in rows],
                "warnings": result.warnings,
                "jit_cache_removed": [str(p) for p in result.jit_cache_removed],
                "exit_code": code,
            }
        )
        return code
    print(f"target: {target.description}")
    report.print_cache_notes(result)
    if not rows:
        print("nothing to restore: no file carries an sm120kit patch")
        return code
    print(report.restore_table(rows))
    if code:
        print("nothing was written", file=sys.stderr)
    return code

"""`patches`, `known-failures`, `status`, `patch`, `unpatch`: the patch engine's commands."""

from __future__ import annotations

import sys

from sm120kit.cli.args import (
    allow_missing_arg,
    allowed_missing,
    command_parser,
    common_args,
    load_target_and_patches,
    patch_args,
    patch_dir_arg,
    target_args,
)
from sm120kit.exit_codes import ExitCode

ERRORS = "an error: anchor-missing, foreign-edit, failed, damaged or unfinished state, or bad input"
AFTER_CHANGE = (
    "the change was made (the files and the ledger are written), then a later step failed: removing "
    "the journal, writing the output; the message says which"
)


def register(sub) -> None:
    """patches, status, patch, unpatch."""
    p = command_parser(
        sub,
        "patches",
        "list the known patches: id, releases, upstream fix",
        "List the patches sm120kit knows (the shipped ones, then those of --patch-dir and "
        "$SM120KIT_PATCH_PATH): the releases each was proven on, its files' ranges merged into one "
        "span; the upstream release that fixed its bug (`open`: none has; one release per part "
        "where its parts were fixed apart); what it does and why, and its files. Looks at no "
        "environment.",
        {ExitCode.OK: "listed", ExitCode.ERROR: "bad input, e.g. a --patch-dir that does not exist or does not load"},
        func=cmd_patches,
    )
    patch_dir_arg(p)
    common_args(p, wide=True)

    p = command_parser(
        sub,
        "known-failures",
        "list the known SM120 failures: releases, upstream, sm120kit's answer",
        "List the survey of known SM120/SM121 failures of sglang and flashinfer "
        "(patches/known-failures.toml, then the known-failures.toml of --patch-dir and "
        "$SM120KIT_PATCH_PATH): the releases whose code has each, checked in the real wheels; "
        "its upstream issue or PR and the release that fixed it; sm120kit's answer (a patch, a "
        "launch rule that `profile check`, `serve`, `bench` and `doctor` enforce, or the flags "
        "that avoid compiled code). Looks at no environment.",
        {ExitCode.OK: "listed", ExitCode.ERROR: "bad input: a survey file that does not validate"},
        func=cmd_known_failures,
    )
    patch_dir_arg(p)
    common_args(p, wide=True)

    p = command_parser(
        sub,
        "status",
        "one row per patch: installed version, outcome, upstream fix",
        "One row per patch and file of the target environment: the installed release, what "
        "`sm120kit patch` would do there (the outcome), and the upstream release that fixed the "
        "bug; then the MoE config tables `sm120kit tune-moe` installed, with the sglang, Triton and GPU "
        "they were tuned for. Writes nothing; `sm120kit patch --check` judges the same, for scripts.",
        {
            ExitCode.OK: "every patch is in place, fixed upstream or not applicable",
            ExitCode.FINDINGS: "a patch would be applied or brought to its current revision, or the ledger "
            "brought up to date (the stale entries of a package uninstalled, an entry lost): the output says so; "
            "run `sm120kit patch`",
            ExitCode.ERROR: ERRORS,
        },
        func=cmd_status,
    )
    target_args(p, python_is="the environment to report on")
    patch_args(p)
    allow_missing_arg(p)
    common_args(p, wide=True)

    p = command_parser(
        sub,
        "patch",
        "apply the patches that the installed releases need",
        "Apply the patches that the installed releases need, in one transaction over all files "
        "(any error: nothing is written), and with --verify prove from disk that every patch is "
        "in place. Run it after every `pip install -U sglang`. --check and --diff write nothing.",
        {
            ExitCode.OK: "applied, or nothing to do (--verify: and proven; --check: nothing would change; "
            "--diff: the diff is printed, empty or not)",
            ExitCode.FINDINGS: "--check only: a patch would change",
            ExitCode.ERROR: f"{ERRORS}; nothing was written (--verify: or the proof failed)",
            ExitCode.AFTER_CHANGE: AFTER_CHANGE,
        },
        func=cmd_patch,
    )
    target_args(p, python_is="the environment to patch")
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
    common_args(p, wide=True)

    p = command_parser(
        sub,
        "unpatch",
        "restore the vendor's bytes, proven against the wheel's RECORD",
        "Restore the vendor's bytes of every file sm120kit patched (with --only, of those patches "
        "alone), each proven against the wheel's RECORD, and drop their ledger entries. Without --only, "
        "the MoE config tables `sm120kit tune-moe` installed go too (a file of sglang's one replaced comes back).",
        {
            ExitCode.OK: "restored, or nothing to restore (--dry-run: what would be restored is listed); a file "
            "removed by hand comes back from its backup, and a ledger entry of a package no longer installed goes",
            ExitCode.ERROR: "a file cannot be restored (foreign-edit: --force; no-backup: reinstall the "
            "package), or bad input; nothing was written",
            ExitCode.AFTER_CHANGE: AFTER_CHANGE,
        },
        func=cmd_unpatch,
    )
    target_args(p, python_is="the environment to restore")
    patch_args(p)
    p.add_argument("--dry-run", action="store_true", help="say what would be restored, write nothing")
    p.add_argument("--force", action="store_true", help="restore the originals even over later edits")
    p.add_argument(
        "--keep-jit-cache", action="store_true", help="keep JIT caches (flashinfer) built from the patched sources"
    )
    common_args(p, wide=True)


def cmd_patches(args) -> int:
    from sm120kit import report
    from sm120kit.patching import render
    from sm120kit.patching.registry import load_patches, shipped_dir

    text, docs = render.patch_listing(load_patches(args.patch_dir), str(shipped_dir()), report.output_width(args.wide))
    report.emit_json({"patches": docs}) if args.json else print(text)
    return ExitCode.OK


def cmd_known_failures(args) -> int:
    from sm120kit import report
    from sm120kit.catalogue.survey import load_survey

    survey = load_survey(args.patch_dir)
    if args.json:
        docs = [f.model_dump(mode="json", by_alias=True, exclude_none=True) for f in survey.failures]
        report.emit_json({"sources": [str(p) for p in survey.sources], "failures": docs})
        return ExitCode.OK
    rows, notes = [], []
    for f in survey.failures:
        answer = (f.answer or "-") + (" + rule" if f.rule and f.answer != "rule" else "")  # (a user's may say none)
        fix = f"patch {f.patch}" if f.patch else f"avoid: {f.avoid}" if f.avoid else ""
        rows.append([f.id, f.package, f.affected, f.fixed_in or report.OPEN, answer])
        notes.append("; ".join(filter(None, [f.title, fix, " ".join(f.upstream)])))
    width = report.output_width(args.wide)
    headers = ["FAILURE", "PACKAGE", "AFFECTED", "FIXED IN", "ANSWER"]
    if width is None:
        print(report.table([*headers, "WHAT"], [[*r, n] for r, n in zip(rows, notes)]))
    else:  # the answer leads the note: a 46-character id and five columns do not fit 80 without breaking the id
        notes = [f"[{r[4]}] {n}" for r, n in zip(rows, notes)]
        print(report.table(headers[:4], [r[:4] for r in rows], width, narrow=(1, 2, 3), notes=notes, whole=(0,)))
    return ExitCode.OK


def cmd_status(args) -> int:
    import os

    from sm120kit import report
    from sm120kit.node import nvml
    from sm120kit.patching import planning, render
    from sm120kit.tune import audit
    from sm120kit.tune import render as tune_render
    from sm120kit.tune.installed import inventory

    target, patches = load_target_and_patches(args)
    plan = planning.plan(target, patches, need_bytes=False, allow_missing=allowed_missing(args))
    tuned = inventory(target)
    unfit = audit.on_this_gpu(target, nvml.gpus_here(), os.environ)
    code = ExitCode.ERROR if tuned.problems else plan.exit_code(check=True)
    if args.json:
        unfit_json = {"tuned_unfit": [t.as_json() for t in unfit]}
        extra = {**tune_render.tuned_json(tuned), **unfit_json, "next": _next_step(args, plan, code)}
        report.emit_json(render.plan_json("status", plan, code, extra))
        return code
    width = report.output_width(args.wide)
    render.print_plan(plan, args.debug, width)
    print(report.wrap(render.summary(plan.findings), width))
    tune_render.print_tuned(tuned, width)
    report.print_warnings([audit.warning(t) for t in unfit], args.wide)
    if said := _next_step(args, plan, code):
        print(report.wrap(said, width))
    return code


def _next_step(args, plan, code: int) -> str | None:
    """The reason for exit 1 of a read-only run (an error's reason is in the table), and
    the `patch` that applies what was judged: the same patches (--only, --allow-missing).
    Where only the ledger would change (its stale or lost entries, each said above), it
    says so rather than "to apply": nothing would be patched. None for another exit."""
    from sm120kit import followup

    if code != ExitCode.FINDINGS:
        return None
    chosen = [
        w
        for option in ("only", "allow_missing")
        for v in getattr(args, option) or ()
        for w in (f"--{option.replace('_', '-')}", v)
    ]
    run = f"run `{followup.command('patch', *chosen)}`"
    return (
        f"would change: {run} to apply"
        if plan.pending
        else f"would change: only sm120kit's ledger: {run} to bring it up to date"
    )


def cmd_patch(args) -> int:
    from sm120kit import followup, report
    from sm120kit.patching import apply, planning, render

    target, patches = load_target_and_patches(args)
    if args.check or args.diff:
        plan = planning.plan(
            target, patches, force=args.force, need_bytes=args.diff, allow_missing=allowed_missing(args)
        )
        code = plan.exit_code(check=args.check)
        diffs = [c.diff() for c in plan.changes] if args.diff else []
        if args.json:
            report.emit_json(
                render.plan_json(
                    "patch",
                    plan,
                    code,
                    {"mode": "diff" if args.diff else "check", "diffs": diffs, "next": _next_step(args, plan, code)},
                )
            )
            return code
        if args.diff:
            sys.stdout.write("".join(diffs))
            for f in plan.errors:
                print(f"error: {f.patch.id}: {f.outcome.value}: {f.detail}", file=sys.stderr)
            return code
    else:
        plan = apply.apply(
            target, patches, force=args.force, keep_jit_cache=args.keep_jit_cache, allow_missing=allowed_missing(args)
        )
        code = plan.exit_code(check=False)
    # nothing installed, only stale entries (now forgotten): nothing left to prove, and no error
    verifiable = args.verify and code == ExitCode.OK and plan.installed
    problems = apply.verify(target, patches) if verifiable else []
    tuned_notes: list[str] = []
    if args.verify and code == ExitCode.OK:
        from sm120kit.tune.installed import verify_tables

        tuned_problems, tuned_notes = verify_tables(target)
        problems += tuned_problems
    if problems:
        code = ExitCode.ERROR
    if args.json:
        mode = "verify" if args.verify else "check" if args.check else "apply"
        report.emit_json(
            render.plan_json(
                "patch",
                plan,
                code,
                {
                    "mode": mode,
                    "verify_problems": problems,
                    "verified": bool(args.verify and code == ExitCode.OK),
                    "tuned_notes": tuned_notes,
                },
            )
        )
        return code
    width = report.output_width(args.wide)
    render.print_plan(plan, args.debug, width)
    written = not (plan.errors or plan.blockers)
    print(report.wrap(render.summary(plan.findings) + ("" if written else "; nothing was written"), width))
    if said := _next_step(args, plan, code):
        print(report.wrap(said, width))
    if args.verify:
        if problems:
            print("verify FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        elif code == ExitCode.OK:
            print(report.wrap(_verified(plan), width))
        for note in tuned_notes:
            print(report.wrap(followup.complete(f"tuned MoE config {note}"), width))
    return code


def _verified(plan) -> str:
    """The line of a green --verify: what was proven, naming the patches let go with
    --allow-missing (anchor-missing: not in place, and not said to be)."""
    if not plan.installed:
        return (
            "verified: nothing the patches change is installed here any more, and the ledger's entries of it are gone"
        )
    allowed = ", ".join(dict.fromkeys(f.patch.id for f in plan.findings if f.allowed))
    every = f"every patch but {allowed}" if allowed else "every patch"
    text = f"verified: {every} is in place, fixed upstream or not applicable, and matches the ledger"
    if allowed:
        text += f"; {allowed}: anchor-missing, not in place (allowed with --allow-missing)"
    return text + ("; unproven on this release: see above" if plan.unproven else "")


def cmd_unpatch(args) -> int:
    from sm120kit import report
    from sm120kit.patching import render, revert
    from sm120kit.tune import removal  # noqa: F401  registers tune-moe's tables with unpatch

    target, patches = load_target_and_patches(args, selected=False)
    only = set(args.only) if args.only else None
    result = revert.unpatch(
        target, patches, only, force=args.force, dry_run=args.dry_run, keep_jit_cache=args.keep_jit_cache
    )
    rows = result.rows
    code = ExitCode.ERROR if any(r.is_error for r in rows) else ExitCode.OK
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
    width = report.output_width(args.wide)
    print(report.wrap(f"target: {target.description}", width))
    render.print_cache_notes(result, width)
    if not rows:
        print("nothing to restore: no file carries an sm120kit patch")
        return code
    print(render.restore_table(rows, width))
    if code:
        print("nothing was written", file=sys.stderr)
    return code

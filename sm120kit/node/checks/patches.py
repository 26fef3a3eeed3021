"""Are the patches in place? One check for every command: serve's preflight and doctor
with a profile judge the profile's patches (a patch not in place fails: serve refuses to
start without it); doctor without one, and bench, survey every known patch (one not yet
applied is a warning, an error such as a missing anchor fails). Patches in place but past
their proven window warn. data["findings"] is each patch's outcome, as bench records it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm120kit.node.check import Check, Status

if TYPE_CHECKING:
    from sm120kit.node.inputs import CheckInputs
    from sm120kit.patching.planning import Plan
    from sm120kit.target import Target

NO_PATCH_CHECK = "or `sm120kit serve --no-patch-check` to start anyway"
UNPROVEN = "run by the shape of the code on a release newer than they were proven on: watch the first requests"


def patches(inputs: CheckInputs) -> Check:
    target = inputs.node.target
    if target is None or not target.find("sglang"):
        return Check("patches", Status.INFO, "no sglang to check")
    if inputs.patch_ids == ():
        return Check("patches", Status.OK, "the profile needs none")
    plan, checked = _plan(target, inputs)
    code = plan.exit_code(check=True)
    data = {
        "findings": [
            {"patch": f.patch.id, "version": f.version, "outcome": f.outcome.value, "proven": not f.unproven}
            for f in plan.findings
        ]
    }
    notes = [f"{f.patch.id}: {f.unproven}" for f in plan.unproven]
    notes += [
        f"{f.patch.id}: anchor-missing on {f.patch.package} {f.version}, allowed (--allow-missing)"
        for f in plan.findings
        if f.allowed
    ]
    if code == 0:
        note = "".join(f"; {n}" for n in dict.fromkeys(notes))
        detail = f"{checked} in place, fixed upstream or not needed{note}"
        if plan.unproven:  # a warning, never a refusal: serve refuses only on a failure
            return Check("patches", Status.WARN, detail, UNPROVEN, data)
        return Check("patches", Status.OK, detail, data=data)
    drift = sorted(
        {
            f"{f.patch.id}: {f.outcome.value}" + (f" ({f.detail})" if f.detail and code == 2 else "")
            for f in plan.errors + plan.pending
        }
    )
    drift += [problem.splitlines()[0] for problem in plan.blockers]
    hints = list(dict.fromkeys(f"{f.patch.id}: {f.hint}" for f in plan.errors if f.hint))
    fix = "; ".join(hints) or (
        "run `sm120kit patch --verify`" if code == 1 else "run `sm120kit status` for the details"
    )
    required = inputs.patch_ids is not None
    return Check(
        "patches",
        Status.FAIL if required or code == 2 else Status.WARN,
        "not in place: " + "; ".join(drift),
        fix + (f"; {NO_PATCH_CHECK}" if required else ""),
        data,
    )


def _plan(target: Target, inputs: CheckInputs) -> tuple[Plan, int]:
    """The plan over the patches judged, and how many they are."""
    from sm120kit.patching import planning
    from sm120kit.patching.registry import load_patches, select

    known = load_patches(list(inputs.patch_dirs) or None)
    select(known, sorted(inputs.allow_missing), "--allow-missing")  # known ids only
    chosen = known if inputs.patch_ids is None else select(known, list(inputs.patch_ids))
    return planning.plan(target, chosen, need_bytes=False, allow_missing=inputs.allow_missing), len(chosen)

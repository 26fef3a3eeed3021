"""Does the profile, rendered for the installed sglang, run into a known SM120 failure
(the survey's launch rules, sm120kit.catalogue)? Doctor's view of what `profile check` and
`serve` refuse: a refused rule fails (the node cannot serve the profile as it is)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm120kit.errors import UserError
from sm120kit.node.check import Check, Status

if TYPE_CHECKING:
    from sm120kit.node.registry import CheckInputs

ID = "known failures"


def known_failures(inputs: CheckInputs) -> Check | None:
    from sm120kit.catalogue import rules
    from sm120kit.profiles.flags import read_schema
    from sm120kit.profiles.render import render

    profile, target = inputs.profile, inputs.node.target
    if profile is None or profile.fleet is not None or not profile.model.path:
        return None
    dist = target.find("sglang") if target is not None else None
    if target is None or dist is None:
        return Check(ID, Status.INFO, "no sglang to render the profile for")
    try:
        launch = render(profile, read_schema(dist), "python")
    except UserError as exc:
        return Check(
            ID,
            Status.FAIL,
            f"the profile does not render for sglang {dist.version}: {exc.message}",
            f"sm120kit profile check {profile.name}",
        )
    judged = rules.check_launch(profile, launch, target, inputs.patch_dirs, sorted(inputs.allowed_failures))
    data = {"rules": [j.as_json() for j in judged]}
    refused = [j for j in judged if j.verdict is rules.Verdict.REFUSED]
    if refused:
        return Check(
            ID,
            Status.FAIL,
            "; ".join(j.message() for j in refused),
            "; ".join(f"{j.failure.id}: {j.fix()}" for j in refused),
            data,
        )
    if notes := rules.warnings(judged):
        return Check(ID, Status.WARN, "; ".join(notes), "read the upstream links above", data)
    covered = [j.failure.id for j in judged]
    detail = f"none on sglang {dist.version}" + (f" (covered: {', '.join(covered)})" if covered else "")
    return Check(ID, Status.OK, detail, data=data)

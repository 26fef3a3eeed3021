"""Does the profile, rendered for the installed sglang, run into a known SM120 failure
(the survey's launch rules, sm120kit.catalogue) or dispatch a kernel with no SM12x build
(sglang's own resolution judged against the kernel table, sm120kit.resolution)? Doctor's
view of what `profile check` and `serve` refuse: a refusal fails (the node cannot serve the
profile as it is)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sm120kit.errors import UserError
from sm120kit.node.check import Check, Status

if TYPE_CHECKING:
    from sm120kit.node.inputs import CheckInputs

ID = "known failures"


def known_failures(inputs: CheckInputs) -> Check | None:
    from sm120kit.node.capability import presented_node
    from sm120kit.profiles.flags import read_schema
    from sm120kit.profiles.render import render
    from sm120kit.resolution import verdict

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
            f"`sm120kit profile check {profile.name}` says what does not fit",
        )
    node = presented_node(profile, inputs.capability)
    found = verdict.judge(profile, launch, target, node, inputs.patch_dirs, sorted(inputs.allowed_failures))
    data = found.as_json()
    if refusal := found.refusal(f"profile {profile.name}", dist.version):
        lines = refusal.message.splitlines()[1:]
        return Check(ID, Status.FAIL, "; ".join(line.strip() for line in lines), refusal.hint or "", data)
    if notes := found.warnings():
        return Check(ID, Status.WARN, "; ".join(notes), "read the upstream links above", data)
    judged = found.rules
    covered = [j.failure.id for j in judged]
    detail = f"none on sglang {dist.version}" + (f" (covered: {', '.join(covered)})" if covered else "")
    return Check(ID, Status.OK, detail, data=data)

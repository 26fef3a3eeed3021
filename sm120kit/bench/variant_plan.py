"""The plan of a search: every variant loaded and rendered for the installed sglang before
anything starts.

The profile as written is always the first variant, "as-written" (the baseline). Planning
loads the profile with each variant's sets and renders it for the installed sglang: a value
of the wrong type is bad input (a UserError, nothing starts); a variant whose `requires`
excludes an installed version, that the installed release cannot take (the renderer's own
message), or that resolves to the same profile as an earlier one is skipped, with why; one
that serve's preflight would refuse on the checks of the profile and the serving
environment (its patches not in place, a package the server imports missing, two of its
ports the same: sm120kit.serve.preflight) is refused, with why, and never started.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sm120kit.bench.variants import BASELINE, Plan, Planned, Variant, VariantStatus
from sm120kit.errors import UserError

if TYPE_CHECKING:
    from sm120kit.profiles.model import Profile
    from sm120kit.profiles.render import Launch
    from sm120kit.serve.options import ServeOptions
    from sm120kit.target import Target


def plan(
    profile_name: str,
    profile_dirs: list[str] | None,
    base_sets: list[str],
    variants: list[Variant],
    target: Target,
    python: str,
    source: str,
    written_for: str | None = None,
    patch_dirs: Sequence[str] = (),
    allowed_failures: Sequence[str] = (),
    capability: str | None = None,
    serve_options: ServeOptions | None = None,
) -> Plan:
    """Load and render every variant (as-written first) for the installed sglang; skip
    those that cannot run, with why: a variant that runs into a known SM120 failure of the
    release, or dispatches a kernel with no SM12x build, is skipped before its load. Bad
    input (a key, a value of the wrong type), and an as-written profile that runs into one,
    raise. With serve_options (those the search serves each variant with), each variant
    that serve's preflight would refuse, off this node, is marked refused."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    from sm120kit.catalogue.survey import load_survey
    from sm120kit.node.capability import presented_node
    from sm120kit.profiles.flags import read_schema
    from sm120kit.profiles.loader import load_profile
    from sm120kit.profiles.render import render

    baseline = load_profile(profile_name, profile_dirs, base_sets)
    loaded = []  # every variant loads (bad input) before the environment is looked at
    for variant in variants:
        try:
            loaded.append((variant, load_profile(profile_name, profile_dirs, [*base_sets, *variant.sets])))
        except UserError as exc:
            raise _bad_variant(exc, variant, source, profile_name, profile_dirs, base_sets) from None
    dist = target.find("sglang")
    if dist is None:
        raise UserError(
            f"sglang is not installed in {target.description}: variants are rendered for the installed release",
            "point sm120kit at the serving environment with --python EXE",
        )
    schema = read_schema(dist)
    notes = []
    if written_for and written_for != profile_name:
        notes.append(f"{source} was written for profile {written_for}; searching {profile_name}")
    launch = render(baseline, schema, python)  # the profile as written must render: else nothing to compare with
    survey = load_survey(list(patch_dirs) or None)  # once for every variant
    from sm120kit.resolution import verdict

    def judge(profile: Profile, launch: Launch) -> verdict.LaunchVerdict:
        node = presented_node(profile, capability)
        return verdict.judge(profile, launch, target, node, patch_dirs, allowed_failures, survey=survey)

    judged = judge(baseline, launch)
    if error := judged.refusal(f"profile {baseline.name} as written", launch.sglang):
        raise error
    launch.warnings.extend(judged.warnings())
    would_refuse = _preflight(target, serve_options)
    as_written = Variant(BASELINE, description="the profile as written")
    preflight_says = would_refuse(baseline, launch)
    status = VariantStatus.REFUSED if preflight_says else VariantStatus.RUNNABLE
    planned = [Planned(as_written, status, preflight_says, baseline, launch, launch.warnings)]
    seen = {_fingerprint(baseline): BASELINE}
    for variant, profile in loaded:
        skip = []
        for package, rng in variant.requires:
            dist_r = target.find(package)
            if dist_r is None:
                skip.append(f"needs {package}{rng}; {package} is not installed")
                continue
            try:
                ok = SpecifierSet(rng).contains(Version(dist_r.version), prereleases=True)
            except InvalidVersion:
                ok = False
            if not ok:
                skip.append(f"needs {package}{rng}; installed: {dist_r.version}")
        if skip:
            planned.append(Planned(variant, VariantStatus.SKIPPED, _with_why("; ".join(skip), variant), profile))
            continue
        twin = seen.get(_fingerprint(profile))
        if twin is not None:
            planned.append(
                Planned(
                    variant, VariantStatus.SKIPPED, f"the same profile as {twin} (nothing it sets differs)", profile
                )
            )
            continue
        try:
            launch = render(profile, schema, python)
        except UserError as exc:
            why = exc.message.split(":\n  ", 1)[-1].replace("\n  ", "; ")  # the renderer's own lines
            planned.append(Planned(variant, VariantStatus.SKIPPED, _with_why(why, variant), profile))
            continue
        judged = judge(profile, launch)
        if refused := judged.refusal(f"variant {variant.name}", launch.sglang):
            why = f"{refused.message.replace(chr(10) + '  ', '; ')}; {refused.hint}"
            planned.append(Planned(variant, VariantStatus.SKIPPED, _with_why(why, variant), profile))
            continue
        launch.warnings.extend(judged.warnings())
        seen[_fingerprint(profile)] = variant.name
        if preflight_says := would_refuse(profile, launch):
            planned.append(Planned(variant, VariantStatus.REFUSED, _with_why(preflight_says, variant), profile, launch))
            continue
        planned.append(Planned(variant, VariantStatus.RUNNABLE, "", profile, launch, launch.warnings))
    return Plan(profile_name, source, planned, notes)


def _preflight(target: Target, options: ServeOptions | None) -> Callable[[Profile, Launch], str]:
    """(profile, launch) -> why serve's preflight would refuse to start it, off this node
    ("" where it would not, or where no options say how it is served). Variants that differ
    in nothing those checks read are judged once (each imports check runs the interpreter)."""
    from sm120kit.node.checks.serving import port_plan
    from sm120kit.serve import preflight

    said: dict[str, str] = {}

    def why(profile: Profile, launch: Launch) -> str:
        if options is None:
            return ""
        read = [launch.entry_points, sorted(launch.env.items()), profile.env, profile.patches, port_plan(profile)]
        key = json.dumps(read, sort_keys=True, default=str)
        if key not in said:
            failed = preflight.run(profile, launch, target, options, on_this_node=False).failed
            found = "; ".join(f"{c.id}: {c.detail}" + (f" (next: {c.fix})" if c.fix else "") for c in failed)
            said[key] = f"serve would refuse to start it: {found}" if failed else ""
        return said[key]

    return why


def _bad_variant(exc: UserError, variant: Variant, source: str, profile_name, profile_dirs, base_sets) -> UserError:
    """The loader's error, naming the --vary value (or the file's variant) at fault: each
    of a --vary combination's values is loaded alone to find it."""
    from sm120kit.profiles.loader import load_profile

    if source != "--vary":
        return UserError(f"{source}: [variants.{variant.name}]: {exc.message}", exc.hint)
    for word in variant.sets:
        try:
            load_profile(profile_name, profile_dirs, [*base_sets, word])
        except UserError as alone:
            return UserError(f"--vary {word}: {alone.message}", alone.hint)
    return UserError(f"--vary {', '.join(variant.sets)} (together): {exc.message}", exc.hint)


def _with_why(text: str, variant: Variant) -> str:
    return f"{text} ({variant.why})" if variant.why else text


def _fingerprint(profile: Profile) -> str:
    return json.dumps(profile.model_dump(mode="json", exclude={"name", "source"}), sort_keys=True)

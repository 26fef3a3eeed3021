"""One verdict on one launch before a load: the survey's launch rules (what is not a
selection question) and the kernels sglang's own resolution dispatches (what is). Every
command that judges a launch — profile check, serve and its preflight, bench, doctor,
render — reads this one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from sm120kit.catalogue import rules
from sm120kit.catalogue.kernels import KernelTable, read_table
from sm120kit.errors import UserError
from sm120kit.resolution.run import Node
from sm120kit.resolution.selection import Selection, judge_launch

if TYPE_CHECKING:
    from sm120kit.catalogue.survey import Survey
    from sm120kit.profiles.model import Profile
    from sm120kit.profiles.render import Launch
    from sm120kit.target import Target


@dataclass
class LaunchVerdict:
    rules: list[rules.Judged]
    selection: Selection | None

    def refusal(self, what: str, sglang: str) -> UserError | None:
        """One UserError for every refused rule and kernel (exit 2), or None. A survey entry
        that a refused kernel accounts for is said once, by the kernel."""
        accounted = {s for j in (self.selection.refused if self.selection else []) for s in j.kernel.survey}
        by_rules = rules.refusal([j for j in self.rules if j.failure.id not in accounted], what)
        known = [j for j in self.rules if j.failure.id in accounted and j.verdict is rules.Verdict.REFUSED]
        by_kernels = self.selection.refusal(what, sglang, known) if self.selection else None
        if by_rules and by_kernels:
            return UserError(f"{by_kernels.message}\n{by_rules.message}", f"{by_kernels.hint}; {by_rules.hint}")
        return by_kernels or by_rules

    def warnings(self) -> list[str]:
        return rules.warnings(self.rules) + (self.selection.warnings() if self.selection else [])

    def as_json(self) -> dict:
        return {
            "rules": [j.as_json() for j in self.rules],
            "selection": self.selection.as_json() if self.selection else None,
        }


def split_allowed(allowed: Sequence[str], table: KernelTable) -> tuple[list[str], frozenset[str]]:
    """--allow-known-failure IDs: (survey ids, kernel ids). A survey id allows the kernels
    that account for it too; an id of neither is left with the survey's, whose check names
    the nearest."""
    kernels = table.kernels
    kernel_ids = {k.id for k in kernels}
    survey_ids = [a for a in allowed if a not in kernel_ids]
    also = {k.id for k in kernels if set(k.survey) & set(survey_ids)}
    return survey_ids, frozenset(a for a in allowed if a in kernel_ids) | also


def judge(
    profile: Profile,
    launch: Launch,
    target: Target,
    node: Node,
    patch_dirs: Sequence[str] = (),
    allowed: Sequence[str] = (),
    render_with: Callable[[list[str]], list] | None = None,
    survey: Survey | None = None,
) -> LaunchVerdict:
    """The rules and the kernels of one rendered launch of `profile` on `target`."""
    table = read_table()
    survey_ids, kernel_ids = split_allowed(allowed, table)
    config, problem = model = rules.model_config(profile.model.path)  # read once, for both
    judged = rules.check_launch(profile, launch, target, patch_dirs, survey_ids, survey, node.capability, model)

    @cache
    def covered(patch_id: str) -> bool:
        return rules.patch_outcome(target, patch_id, patch_dirs) in rules.IN_PLACE

    selection = judge_launch(
        launch.argv, launch.env, target, node, config, kernel_ids, render_with, table, problem, covered
    )
    return LaunchVerdict(judged, selection)

"""Judge what a launch dispatches against the kernel table: each kernel its slots select,
on the installed releases and the node's capability, runs, does not, or is not in the
table for this release.

Off SM12x nothing is judged: the table speaks of SM12x builds only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sm120kit.catalogue.kernels import Kernel, KernelTable, Support


class KernelVerdict(str, enum.Enum):
    RUNS = "runs"
    NO_BUILD = "no-sm12x-build"
    UNKNOWN = "not-in-table"  # no row of the table covers the installed release
    ALLOWED = "allowed"  # no build, but --allow-known-failure names it
    COVERED = "covered"  # no build, but the kernel's patched_by patch is in place


@dataclass(frozen=True)
class Judged:
    kernel: Kernel
    choice: str  # the slot assignment that dispatched it, e.g. "dsa.decode=trtllm"
    verdict: KernelVerdict
    row: Support | None  # the row that decided
    choices: tuple[str, ...] = ()  # every assignment of the launch that dispatches it (the phases)
    past: str = ""  # "sglang read through 0.5.23" where the installed release is newer: unverified

    def message(self, release: str, basis: str) -> str:
        slot, _, value = self.choice.partition("=")
        head = f"{self.kernel.id} ({self.kernel.title})"
        led = f"{release} resolves {slot} to {value}"
        if self.verdict is KernelVerdict.UNKNOWN:
            return f"{head}: {led}; the kernel table has no row for this release ({basis})"
        evidence = f"; {self.row.package} {self.row.releases}: {self.row.evidence}" if self.row else ""
        if self.past:
            evidence += f" (the table was {self.past}: unverified on this release)"
        allowed = " (allowed by --allow-known-failure)" if self.verdict is KernelVerdict.ALLOWED else ""
        if self.verdict is KernelVerdict.COVERED:
            allowed = f" (covered: {self.kernel.patched_by} is in place)"
        return f"{head}: {led}, which has no SM12x build{allowed}{evidence} ({basis})"

    def as_json(self) -> dict:
        return {
            "kernel": self.kernel.id,
            "title": self.kernel.title,
            "choice": self.choice,
            "choices": list(self.choices or (self.choice,)),
            "verdict": self.verdict.value,
            "evidence": self.row.evidence if self.row else None,
            "releases": f"{self.row.package} {self.row.releases}" if self.row else None,
            "upstream": list(self.kernel.upstream),
            "unverified": self.past or None,
            "survey": list(self.kernel.survey),
        }


def _holds(assignment: str, facts: Mapping[str, str]) -> bool:
    key, _, value = assignment.partition("=")
    if key.endswith("!"):
        return facts.get(key[:-1]) != value
    return facts.get(key) == value


def dispatched(
    table: KernelTable, slots: Mapping[str, str], record: Mapping[str, object], env: Mapping[str, str] | None = None
) -> list[tuple[Kernel, list[str]]]:
    """(kernel, the assignments that select it) for every kernel the launch dispatches;
    `env` is the server's environment (env.NAME in a kernel's `when`)."""
    facts = {**{k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in record.items()}, **slots}
    facts.update({f"env.{k}": v for k, v in (env or {}).items()})
    found = []
    for kernel in table.kernels:
        choices = [a for a in kernel.dispatched_by if _holds(a, slots)]
        if choices and all(_holds(a, facts) for a in kernel.when):
            found.append((kernel, choices))
    return found


def judge(
    table: KernelTable,
    slots: Mapping[str, str],
    record: Mapping[str, object],
    versions: Mapping[str, str],
    capability: str,
    allowed: frozenset[str] = frozenset(),
    env: Mapping[str, str] | None = None,
    covered: Callable[[str], bool] = lambda patch_id: False,
) -> list[Judged]:
    """Every dispatched kernel with its verdict on `capability` (nothing off SM12x).
    covered(patch_id): is that patch in place on the target."""
    if not capability.startswith("12."):
        return []
    out = []
    for kernel, choices in dispatched(table, slots, record, env):
        runs, row, past = kernel.judge(versions, capability, table.read_through)
        if runs is None:
            verdict = KernelVerdict.UNKNOWN
        elif runs:
            verdict = KernelVerdict.RUNS
        elif kernel.patched_by and covered(kernel.patched_by):
            verdict = KernelVerdict.COVERED
        else:
            verdict = KernelVerdict.ALLOWED if kernel.id in allowed else KernelVerdict.NO_BUILD
        out.append(Judged(kernel, choices[0], verdict, row, tuple(choices), past))
    return out


def alternatives(
    table: KernelTable, slot: str, versions: Mapping[str, str], capability: str, current: str
) -> list[str]:
    """The values of `slot` whose kernels the table says run here, table order."""
    found: list[str] = []
    for kernel in table.kernels:
        runs, _, _ = kernel.judge(versions, capability, table.read_through)
        if not runs:
            continue
        for assignment in kernel.dispatched_by:
            key, _, value = assignment.partition("=")
            if key == slot and value != current and value not in found:
                found.append(value)
    return found

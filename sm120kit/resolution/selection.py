"""What a launch will run on this node, and the verdict: sglang's own resolution (or, where
it cannot run, the flags), its slots, each dispatched kernel judged against the kernel
table, and for a kernel with no SM12x build a way out that was itself resolved and judged
clean.

Every verdict says its basis: "resolved by sglang 0.5.23's own code on capability 12.0",
or "judged from the flags" and why sglang's resolution could not run here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, get_args

from sm120kit.catalogue import rules
from sm120kit.catalogue.kernels import KernelTable, Package, read_table
from sm120kit.errors import UserError
from sm120kit.resolution import judge as kernel_judge
from sm120kit.resolution import run, slots

if TYPE_CHECKING:
    from sm120kit.target import Distribution, Target

# The profile key that chooses each slot: what a way out sets.
SETTINGS = {
    "attention.prefill": "engine.prefill_attention_backend",
    "attention.decode": "engine.decode_attention_backend",
    "dsa.prefill": "engine.dsa_prefill_backend",
    "dsa.decode": "engine.dsa_decode_backend",
    "moe.runner": "engine.moe_runner_backend",
    "kv_cache_dtype": "engine.kv_cache_dtype",
    "fp4_gemm": "engine.fp4_gemm_backend",
}
# A DSA backend with no build may have no clean sibling on a release (0.5.9-0.5.16): then
# another attention backend for the model is the way out.
FALLBACKS = {
    "dsa.prefill": (("attention.prefill", "engine.attention_backend"),),
    "dsa.decode": (("attention.decode", "engine.attention_backend"),),
}
WAY_OUT_CANDIDATES = 4  # per refused kernel: each costs a resolution (one child for all)
KERNEL_PACKAGES = get_args(Package)  # the packages whose installed release the table's rows name
OFF_ENV = "SM120KIT_RESOLUTION"  # "off": judge from the flags, never start the probe
QUIET = ("no torch", f"${OFF_ENV}")  # where not resolving is expected: the basis says it, no warning


@dataclass
class Selection:
    capability: str
    capability_from: str  # where it was read: --capability, the profile, NVML
    basis: str
    resolved_by_sglang: bool
    slots: dict[str, str]
    judged: list[kernel_judge.Judged]
    resolution: run.Resolution | None = None
    way_out: list[str] = field(default_factory=list)  # --set assignments, resolved and judged clean
    unresolved: str = ""  # why sglang's resolution did not run where it should have: a warning

    @property
    def refused(self) -> list[kernel_judge.Judged]:
        return [j for j in self.judged if j.verdict is kernel_judge.KernelVerdict.NO_BUILD]

    def warnings(self) -> list[str]:
        notes = [self.unresolved] if self.unresolved else []
        release = f"sglang {self.resolution.sglang}" if self.resolution and self.resolution.sglang else "sglang"
        for j in self.judged:
            if j.verdict in (kernel_judge.KernelVerdict.UNKNOWN, kernel_judge.KernelVerdict.ALLOWED):
                notes.append(j.message(release, self.basis))
        return notes

    def refusal(self, what: str, sglang: str, known: Sequence[rules.Judged] = ()) -> UserError | None:
        """The refusal of every kernel with no build; `known`: the survey's refused entries
        that these kernels account for, said with them (and their fixes offered too)."""
        refused = self.refused
        if not refused:
            return None
        lines = [f"{what} dispatches {len(refused)} kernel(s) with no SM12x build, before any load:"]
        lines += [f"  {j.message(f'sglang {sglang}', self.basis)}" for j in refused]
        for j in known:
            lines += [f"  that is {j.message()}", f"    avoid: {j.fix()}"]
        ids = " ".join(f"--allow-known-failure {j.kernel.id}" for j in refused)
        if self.way_out:
            sets = " ".join(f"--set {s}" for s in self.way_out)
            flags = f" (sglang flags: {' '.join(_flags_for(self.way_out))})"
            how = "sglang's own resolution" if self.resolved_by_sglang else "the kernel table"
            hint = f"add {sets}{flags}, which {how} finds clean; or allow it anyway with {ids}"
        elif any(j.choice.partition("=")[0] in SETTINGS for j in refused):
            hint = f"choose another backend for the slot named above, or allow it anyway with {ids}"
        else:  # the model's architecture, or a switch no profile key sets, dispatches it
            hint = f"no profile setting avoids it on this release; allow it anyway with {ids}"
        if known:
            hint += "; or: " + "; ".join(j.fix() for j in known)
        return UserError("\n".join(lines), hint)

    def as_json(self) -> dict:
        return {
            "capability": self.capability,
            "capability_from": self.capability_from,
            "basis": self.basis,
            "resolved_by_sglang": self.resolved_by_sglang,
            "slots": self.slots,
            "kernels": [j.as_json() for j in self.judged],
            "way_out": self.way_out,
            "resolution": self.resolution.as_json() if self.resolution else None,
        }


def judge_launch(
    argv: list,
    env: Mapping[str, str],
    target: Target,
    node: run.Node,
    model_config: Mapping | None,
    allowed: frozenset[str] = frozenset(),
    render_with: Callable[[list[str]], list] | None = None,
    table: KernelTable | None = None,
    model_problem: str = "",
    covered: Callable[[str], bool] = lambda patch_id: False,
) -> Selection | None:
    """The selection of one rendered launch (argv: [python, -m, module, flags...]) on the
    node; None off SM12x. A launch sglang itself refuses is a UserError with its message.
    render_with(sets) renders the same profile with more --set assignments (the way out).
    Without the model's config.json (model_problem says why) sglang cannot resolve: the
    flags are judged, and a warning says so. covered(patch_id): is that sm120kit patch in
    place (a kernel it reroutes then runs)."""
    if not node.capability.startswith("12."):
        return None
    table = table or read_table()
    dist = target.find("sglang")
    if dist is None:
        return None
    versions = {p: d.version for p in KERNEL_PACKAGES if (d := target.find(p))}
    python, server_env = _interpreter(argv, env, target)
    context = _Context(table, versions, python, server_env, node, dist, target, model_config, covered)
    resolutions: list[run.Resolution] = []
    reason = context.unavailable() or (f"the model's config.json: {model_problem}" if model_config is None else "")
    if not reason:
        resolutions, reason = context.resolve([argv])
    resolution = resolutions[0] if resolutions else None
    if resolution is not None and resolution.rejected:
        raise UserError(
            f"sglang {dist.version} refuses this launch at argument time ({resolution.stage}): {resolution.error}",
            "change the profile's setting named in sglang's message; `sm120kit profile show PROFILE` shows them",
        )
    if resolution is not None and resolution.ok:
        basis = f"resolved by sglang {resolution.sglang}'s own code on capability {node.capability}"
        record, by_sglang = resolution.resolved, True
    else:
        reason = reason or (f"{resolution.stage}: {resolution.error}" if resolution else "not run")
        record, by_sglang = slots.from_flags(run.flags_of(argv)), False
        basis = (
            f"judged from the flags on capability {node.capability} (sglang's own resolution could not run: {reason})"
        )
    filled = slots.fill(record, model_config)
    judged = context.judge(record, allowed)
    selection = Selection(node.capability, node.source, basis, by_sglang, filled, judged, resolution)
    if not by_sglang and not reason.startswith(QUIET):
        selection.unresolved = f"sglang's own resolution could not run ({reason}): {basis.split(' (')[0]}"
    if selection.refused and render_with is not None:
        selection.way_out = context.way_out(selection.refused, render_with)
    return selection


def _interpreter(argv: list, env: Mapping[str, str], target: Target) -> tuple[str, dict[str, str]]:
    """The server's interpreter and environment; a --site target's dirs go on PYTHONPATH
    (its interpreter is a guess that does not know them)."""
    python = str(argv[0]) if argv else "python3"
    server_env = dict(env)
    sites = [str(d) for d in target.site_dirs]
    if sites and target.description.startswith("site"):
        existing = server_env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        server_env["PYTHONPATH"] = os.pathsep.join([*sites, *([existing] if existing else [])])
    return python, server_env


@dataclass(frozen=True)
class _Context:
    """What every resolution of one profile on one target shares."""

    table: KernelTable
    versions: dict[str, str]
    python: str
    env: dict[str, str]
    node: run.Node
    dist: Distribution
    target: Target
    model_config: Mapping | None
    covered: Callable[[str], bool]

    def unavailable(self) -> str:
        """Why sglang's resolution cannot run in the target at all ("" where it can)."""
        if os.environ.get(OFF_ENV, "").lower() == "off":
            return f"${OFF_ENV}=off"
        if self.target.find("torch") is None:
            return f"no torch in {self.target.description}"
        return ""

    def resolve(self, argvs: list[list]) -> tuple[list[run.Resolution], str]:
        """sglang's resolutions (one child for all), or none and why they cannot run here."""
        if reason := self.unavailable():
            return [], reason
        return run.resolve(self.python, argvs, self.env, self.node, self.dist.version, fingerprint(self.dist)), ""

    def refused_ids(self, argv: list, resolution: run.Resolution | None) -> set[str] | None:
        """The kernels with no build that `argv` dispatches; None where sglang refuses it."""
        if resolution is not None and not resolution.ok:
            return None
        record = resolution.resolved if resolution is not None else slots.from_flags(run.flags_of(argv))
        return {j.kernel.id for j in self.judge(record) if j.verdict is kernel_judge.KernelVerdict.NO_BUILD}

    def judge(self, record: Mapping[str, object], allowed: frozenset[str] = frozenset()) -> list[kernel_judge.Judged]:
        filled = slots.fill(record, self.model_config)
        environment = {**os.environ, **self.env}  # the server's, as sglang reads it
        return kernel_judge.judge(
            self.table, filled, record, self.versions, self.node.capability, allowed, environment, self.covered
        )

    def judge_all(self, trials: list[list[str]], render_with) -> list[set[str] | None]:
        """refused_ids of the launch rendered with each trial's --set assignments."""
        rendered: list[list | None] = []
        for sets in trials:
            try:
                rendered.append(render_with(sets))
            except UserError:  # the installed release lacks that choice
                rendered.append(None)
        argvs = [a for a in rendered if a is not None]
        resolutions, _ = self.resolve(argvs) if argvs else ([], "")
        answers = iter(resolutions)
        out: list[set[str] | None] = []
        for argv in rendered:
            if argv is None:
                out.append(None)
                continue
            out.append(self.refused_ids(argv, next(answers, None)))
        return out

    def way_out(self, refused: list[kernel_judge.Judged], render_with) -> list[str]:
        """For each refused kernel the first alternative of its slot that clears it (all
        candidates resolved by one child), then all of them together, judged once more:
        the --set assignments, or [] where none is clean."""
        trials: list[tuple[str, list[str]]] = []
        for judged in refused:
            slot, _, value = judged.choice.partition("=")
            for tried, setting in ((slot, SETTINGS.get(slot)), *FALLBACKS.get(slot, ())):
                if setting is None:
                    continue
                current = value if tried == slot else ""
                found = kernel_judge.alternatives(self.table, tried, self.versions, self.node.capability, current)
                trials += [(judged.kernel.id, [f"{setting}={v}"]) for v in found[:WAY_OUT_CANDIDATES]]
        verdicts = self.judge_all([sets for _, sets in trials], render_with)
        chosen: dict[str, str] = {}
        cleared = [
            (k, sets, still) for (k, sets), still in zip(trials, verdicts) if still is not None and k not in still
        ]
        for kernel_id, sets, _ in sorted(cleared, key=lambda t: bool(t[2])):  # wholly clean ones first
            chosen.setdefault(kernel_id, sets[0])
        together = list(dict.fromkeys(chosen.values()))
        if not together:
            return []
        final = self.judge_all([together], render_with)[0]
        return together if final is not None and not final else []


def fingerprint(dist: Distribution) -> str:
    """server_args.py's size and time: an editable install changes without a new version."""
    try:
        st = dist.file("sglang/srt/server_args.py").stat()
    except OSError:
        return ""
    return f"{st.st_size}:{st.st_mtime_ns}"


def _flags_for(sets: list[str]) -> list[str]:
    """--set engine.dsa_decode_backend=x -> --dsa-decode-backend x (as the operator types it)."""
    return [f"--{key.split('.')[-1].replace('_', '-')} {value}" for key, _, value in (s.partition("=") for s in sets)]

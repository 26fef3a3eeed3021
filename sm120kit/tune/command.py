"""`sm120kit tune-moe`: the profile's MoE shape, the tuner's space pruned to what fits sm_120,
timing on this node's GPUs, and the winning table installed where sglang looks.

The options are options.py's, the report tune_report.py's, the choice of a Triton
compiler.py's: this module runs the tune's steps in order.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from sm120kit.errors import UserError
from sm120kit.tune import install as _install
from sm120kit.tune.compiler import Compiler, find_compiler
from sm120kit.tune.options import TuneOptions
from sm120kit.tune.tune_report import TuneReport

if TYPE_CHECKING:  # timing is imported when the candidates are timed, not to plan
    from sm120kit.profiles.model import Profile
    from sm120kit.target import Distribution, Target
    from sm120kit.tune.model_config import NotTritonMoe


def tune_moe(options: TuneOptions, profile: Profile, target: Target) -> TuneReport:
    """Plan (shape, candidates that fit sm_120, where the table goes, what sglang loads now);
    unless options.plan_only, time the candidates on the GPUs and install the winners."""
    from sm120kit.tune import fit, kernels, lookup, space
    from sm120kit.tune.model_config import NotTritonMoe, moe_shape

    sglang = target.find("sglang")
    if sglang is None:
        raise UserError(
            f"no sglang in {target.description}: tune-moe tunes the installed sglang's kernel",
            "pip install sglang, or point --python at the environment that serves it",
        )
    try:
        shape = moe_shape(profile, _model_config(profile, options.model_config), sglang_version=sglang.version)
    except NotTritonMoe as exc:
        raise _with_triton_profile(exc, profile) from None
    triton_version = lookup.installed_triton_version(target)
    kernel = kernels.find_kernel_file(sglang.site)
    source = kernel.read_bytes()
    compiler = find_compiler(target, options.python)
    candidates = space.search_space(shape)
    results = fit.fit_configs(
        source,
        shape,
        candidates,
        jobs=options.jobs,
        progress=_progress_printer("compiling for sm_120", options.show_progress),
        python=compiler.python,
    )
    fitting = [r.config for r in results if r.fits]
    over = sorted((r for r in results if not r.fits), key=lambda r: -(r.shared or r.at_least or 0))
    config_dir = _config_dir(options, profile)
    if problem := lookup.server_env_problem(profile.env, config_dir):
        raise UserError(f"profile {profile.name}: {problem}", _env_hint(profile, config_dir))
    result = TuneReport(
        profile=profile.name,
        shape=shape,
        sglang=sglang.version,
        triton=triton_version,
        compiler=compiler.version,
        compiler_python=str(compiler.python) if compiler.python else None,
        kernel=str(kernel),
        space=len(candidates),
        fitting=fitting,
        largest_fit=max((r.shared or 0 for r in results if r.fits), default=0),  # a fit has its bytes
        rejected=_distinct_tiles(over)[:3],
        device_name=options.device_name,
        destination=None,
        loads_now=None,
        batch_sizes=options.batch_sizes,
    )
    if triton_version and triton_version != result.compiler:
        result.notes.append(
            f"note: the kernels were compiled with Triton {result.compiler}; sglang runs with {triton_version}"
        )
    if result.device_name and triton_version:
        _where(result, sglang, result.device_name, triton_version, config_dir, profile.env, source, options, compiler)
    elif not result.device_name:
        result.notes.append("no GPU here: pass --device-name to see where the table goes and what sglang loads now")
    else:
        result.notes.append(
            f"no Triton in {target.description}: its version names the directory sglang reads, so where the "
            "table goes and what sglang loads now are not known here"
        )
    if options.plan_only:
        return result
    if not fitting:
        raise UserError(f"no config of sglang's tuning space fits sm_120 for {shape.model}", "see tune-moe --plan")
    return _time_and_install(result, options, profile, target, sglang, config_dir)


def _distinct_tiles(results) -> list[dict]:
    """The results as {config, shared, error}, one per tile (GROUP_SIZE_M does not change what is compiled)."""
    seen, out = set(), []
    for r in results:
        tile = tuple(v for k, v in sorted(r.config.items()) if k != "GROUP_SIZE_M")
        if tile not in seen:
            seen.add(tile)
            out.append({"config": r.config, "shared": r.shared or r.at_least, "error": r.error})
    return out


def _with_triton_profile(exc: NotTritonMoe, profile: Profile) -> UserError:
    """NotTritonMoe's message, pointing at a shipped or local profile `<name>-triton` when one exists."""
    from sm120kit.profiles.loader import list_profiles

    twin = f"{profile.name}-triton"
    if twin in {name for name, _, _ in list_profiles()}:
        return UserError(exc.message, f"sm120kit tune-moe {twin} (the same model on the Triton runner)")
    return exc


def _config_dir(options: TuneOptions, profile: Profile) -> Path | None:
    """--config-dir, else the $SGLANG_MOE_CONFIG_DIR the profile's server runs with."""
    chosen = options.config_dir or (
        Path(profile.env[_install.CONFIG_DIR_ENV]) if profile.env.get(_install.CONFIG_DIR_ENV) else None
    )
    return chosen.expanduser().absolute() if chosen else None


def _env_hint(profile: Profile, config_dir: Path | None) -> str:
    if config_dir is None:
        return f"drop {_install.CONFIG_DIR_ENV} from the profile's [env], or pass --config-dir with its value"
    return f'add {_install.CONFIG_DIR_ENV} = "{config_dir}" to [env] of {profile.source or profile.name}'


def _model_config(profile: Profile, given: Path | None) -> Path | None:
    """--model-config, else the profile's config.json (None: no [model] path, which
    moe_shape refuses). Where there is none: a profile known not to run its MoE on Triton
    says so first; otherwise the error names --model-config."""
    from sm120kit.model_config import find_model_config

    try:
        if given is not None:
            if not given.is_file():
                what = "not a file" if given.exists() else "no such file"
                raise UserError(f"--model-config {given}: {what}", "pass the path of the model's config.json")
            return given
        return find_model_config(profile.model.path) if profile.model.path else None
    except UserError as exc:
        if known := _not_triton_without_config(profile):
            raise known from None
        if given is not None:
            raise
        raise UserError(exc.message, f"pass the model's config.json with --model-config FILE, or {exc.hint}") from None


def _not_triton_without_config(profile: Profile) -> UserError | None:
    """What the profile alone says about its MoE runner: an engine.moe_runner_backend other
    than triton, or (left to sglang) a `<name>-triton` profile of the same model that puts it
    on Triton, which exists because sglang's own choice is another kernel (Marlin, for
    kimi-k2-int4)."""
    from sm120kit.profiles.loader import list_profiles, load_profile
    from sm120kit.tune.model_config import NotTritonMoe

    backend = profile.engine.moe_runner_backend or "auto"
    if backend not in ("auto", "triton"):
        exc = NotTritonMoe(profile.name, backend, f"engine.moe_runner_backend = {backend!r} in the profile", None)
        return _with_triton_profile(exc, profile)
    twin = f"{profile.name}-triton"
    if backend != "auto" or twin not in {name for name, _, _ in list_profiles()}:
        return None
    try:
        other = load_profile(twin, None, [])
    except UserError:
        return None
    if other.engine.moe_runner_backend != "triton" or other.model.path != profile.model.path:
        return None
    said = f" (the profile says: {profile.description})" if profile.description else ""
    return UserError(
        f"profile {profile.name} leaves its MoE runner to sglang, which does not run this model's experts on "
        f"the Triton fused-MoE kernel{said}; sglang would not load Triton fused-MoE configs for it",
        f"sm120kit tune-moe {twin} (the same model on the Triton runner)",
    )


def _where(
    result: TuneReport,
    sglang: Distribution,
    device_name: str,
    triton_version: str,
    config_dir: Path | None,
    env: dict[str, str],
    source: bytes,
    options: TuneOptions,
    compiler: Compiler,
) -> None:
    """Where the tuned table goes, what sglang loads today for this shape on this GPU, and
    which of that table's configs do not fit sm_120 (a file copied from another card)."""
    from sm120kit.tune import fit, lookup

    result.destination = lookup.config_destination(
        sglang, result.shape, device_name, triton_version, config_dir=config_dir
    )
    loaded = lookup.what_sglang_loads(sglang, result.shape, device_name, triton_version, lookup.server_env(config_dir))
    if loaded is None:
        return
    result.loads_now = loaded.path
    configs = list(loaded.table.values())
    checked = fit.fit_configs(source, result.shape, configs, jobs=options.jobs, python=compiler.python)
    result.loads_now_over = [
        {"batch_size": m, "config": r.config, "shared": r.shared or r.at_least, "error": r.error}
        for m, r in zip(loaded.table, checked)
        if not r.fits
    ]


def _time_and_install(
    result: TuneReport,
    options: TuneOptions,
    profile: Profile,
    target: Target,
    sglang: Distribution,
    config_dir: Path | None,
) -> TuneReport:
    from sm120kit.caches import cache_dir
    from sm120kit.tune import timing
    from sm120kit.tune.install import TuneMeta, install_table
    from sm120kit.tune.timing_result import Stop
    from sm120kit.tune.worker_client import probe

    if options.python is None and not target.description.startswith("python "):
        raise UserError("--site names files, not an interpreter: timing runs the target's python", "pass --python EXE")
    python = Path(options.python or sys.executable)
    gpus = list(options.gpus) if options.gpus is not None else list(range(len(probe(python).devices)))
    state = cache_dir("tune") / f"{profile.name}.json"
    if options.restart:
        state.unlink(missing_ok=True)
    timed = timing.time_candidates(
        python,
        result.shape,
        options.batch_sizes,
        result.fitting,
        gpus,
        budget_s=options.budget_s,
        state_path=state,
        progress=_progress_printer("timing", options.show_progress),
    )
    result.timing = timed
    result.notes += timed.notes
    if timed.stop is Stop.INTERRUPTED:
        result.interrupted = True
        result.notes.append(f"interrupted: {len(timed.rows)} batch size(s) kept for the next run; nothing installed")
        return result
    table = timed.best_configs()
    if not table:
        result.notes.append("no batch size finished: nothing installed")
        return result
    meta = TuneMeta(result.shape, sglang.version, result.triton or "", timed.device, profile=profile.name)
    installed = install_table(target, table, meta, config_dir=config_dir)
    result.installed = True
    result.device_name = timed.device
    result.destination = installed.tables[0].path if installed.tables else result.destination
    result.notes += installed.warnings
    if timed.pending:
        result.notes.append(
            f"the budget ran out: batch sizes {', '.join(map(str, timed.pending))} not timed; "
            f"run `sm120kit tune-moe {profile.name}` again to go on"
        )
    return result


def _progress_printer(what: str, enabled: bool):
    """A one-line progress display on stderr at a terminal (nothing in logs and pipes)."""
    if not (enabled and sys.stderr.isatty()):
        return None

    def show(done: int, total: int, detail: str = "") -> None:
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r\033[K{what}: {done}/{total} {detail}"[:200] + end)
        sys.stderr.flush()

    return show

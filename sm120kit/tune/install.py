"""Tuned fused-MoE config tables, installed where the installed sglang loads them, as tracked
changes of the target: the same lock, crash-safe transaction, backups and ledger as the
patches (sm120kit/patching/), so that `status` lists them, `unpatch` takes them out (and puts
back a file of sglang's they replaced, byte for byte) and an upgrade is noticed.

Two places a table can go, both computed by the release's own lookup (lookup.py):

  the package   <sglang's MoE module dir>/configs/triton_<ver>/<name>, recorded in the
                target's ledger (root "package");
  a config dir  $SGLANG_MOE_CONFIG_DIR/configs/triton_<ver>/<name>, recorded in the config
                dir's own ledger (<dir>/.sm120kit/, root "config-dir"): the state lives with
                the tables, so a volume mounted into a fresh container still knows them. The
                target's ledger keeps a pointer to the directory (`moe_config_dirs`) where it
                can be written, for status and unpatch.

sglang reads only $SGLANG_MOE_CONFIG_DIR when it is set, so its own tables for this GPU
(any shape, any triton_* directory) are copied beside ours: every lookup of this GPU then
finds what it found in the package. Copies, not symbolic links, so that they survive in a
volume without the image they came from; they are tracked too (kind "shipped"), refreshed by
the next install and removed by unpatch. 0.5.12+ also lists <dir>/configs on every miss and
fails if it is missing: the install creates it, and a lookup of a shape nobody tuned is run
on the result before anything is written.

This module writes them; installed.py reads them back (status, patch --verify) and
removal.py takes them out (unpatch).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from sm120kit import shallow_json
from sm120kit.errors import UserError
from sm120kit.patching import transaction, writing
from sm120kit.patching.ledger import Ledger, ReadOnly, sha256
from sm120kit.patching.ledger_entries import TunedEntry, is_table_path
from sm120kit.target import Distribution, Target
from sm120kit.tune.installed import CHANGE, PACKAGE, InstalledTable, installed_table, read_table_file
from sm120kit.tune.lookup import (
    CONFIG_DIR_ENV,
    config_destination,
    config_module,
    installed_triton_version,
    server_env,
    table_for_device,
    what_sglang_loads,
)
from sm120kit.tune.shape import MoeShape

CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M")


@dataclass(frozen=True)
class TuneMeta:
    """What a table was tuned for."""

    shape: MoeShape
    sglang_version: str
    triton_version: str
    device_name: str  # torch.cuda.get_device_name(), e.g. "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    profile: str = ""  # `sm120kit tune-moe PROFILE` tunes it again
    down: bool = False  # the down projection's table (`_down` in the name)
    tuned_at: str = ""  # ISO 8601; "" = when it is installed


@dataclass(frozen=True)
class Table:
    configs: dict[int, dict]  # batch size M -> the kernel config sglang picks for the M nearest
    meta: TuneMeta


@dataclass
class Installed:
    """What install_tables did."""

    tables: list[InstalledTable]
    copied: list[Path] = field(default_factory=list)  # sglang's own tables copied into the config dir
    removed: list[Path] = field(default_factory=list)  # copies of another release's tables taken out
    warnings: list[str] = field(default_factory=list)
    server_env: dict[str, str] = field(default_factory=dict)  # what the server's environment must carry


# -- the file ------------------------------------------------------------------------------


def table_bytes(configs: Mapping[int, dict]) -> bytes:
    """The JSON as sglang's tuner saves it (json.dump(..., indent=4) and a newline; the batch
    sizes, ascending, as string keys) and as sglang's shipped tables are written."""
    return (json.dumps({str(m): configs[m] for m in sorted(configs)}, indent=4) + "\n").encode()


def _check_configs(configs: Mapping[int, dict], what: str) -> None:
    """A table that sglang's loader takes: int batch sizes, each a dict of int parameters."""
    if not configs:
        raise ValueError(f"{what}: an empty table")
    for m, config in configs.items():
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"{what}: batch size {m!r} is not a positive int")
        if not isinstance(config, dict) or not set(CONFIG_KEYS) <= set(config):
            raise ValueError(f"{what}: the config for M={m} lacks {', '.join(CONFIG_KEYS)}")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in config.values()):
            raise ValueError(f"{what}: the config for M={m} has a value that is not an int: {config}")


# -- installing ----------------------------------------------------------------------------


def install_table(
    target: Target,
    configs: dict[int, dict],
    meta: TuneMeta,
    *,
    config_dir: Path | None = None,
    force: bool = False,
) -> Installed:
    """install_tables for one table."""
    return install_tables(target, [Table(configs, meta)], config_dir=config_dir, force=force)


def install_tables(
    target: Target, tables: Sequence[Table], *, config_dir: Path | None = None, force: bool = False
) -> Installed:
    """Write each table where the installed sglang loads it first (the package, or
    `config_dir` as $SGLANG_MOE_CONFIG_DIR), as one transaction recorded in the ledger. Before
    anything is written, the release's own lookup is run on the files as they will be and
    must return each table from its file. A file there that is neither sglang's (RECORD) nor
    ours is refused unless `force` (then it is backed up, and unpatch puts it back).
    UserError for bad input (versions that are not the installed ones, a relative config
    dir, a read-only target), with nothing written."""
    sglang = _sglang(target)
    triton = installed_triton_version(target)
    for table in tables:
        _check_table(table, sglang, triton)
    if config_dir is not None:
        config_dir = _config_dir(config_dir, sglang)
    pointer = config_dir is not None and _can_write(Ledger(sglang.site).state_dir)
    sites = {config_dir} if config_dir is not None else {sglang.site}
    if pointer:
        sites.add(sglang.site)
    with _read_only_hint(config_dir), _locked(target, sites, config_dir) as recovered:
        ledgers = {site: Ledger.load(site) for site in sorted(sites)}
        plan = _Plan(sglang, config_dir, ledgers[config_dir or sglang.site], force)
        for table in tables:
            plan.add(table)
        if config_dir is not None:
            plan.mirror(config_dir, {t.meta.device_name for t in tables})
        plan.prove(tables)
        if pointer and str(config_dir) not in ledgers[sglang.site].moe_config_dirs:
            ledgers[sglang.site].moe_config_dirs.append(str(config_dir))
        writes = list(plan.writes.values())
        if writes or any(ledger.changed for ledger in ledgers.values()):
            writing.write(ledgers, writes, CHANGE)
    result = Installed(
        [installed_table(sglang, triton, plan.ledger, key, config_dir) for key in plan.tables],
        copied=plan.copied,
        removed=plan.removed,
        warnings=list(recovered),
        server_env=server_env(config_dir),
    )
    if config_dir is not None and not pointer:
        result.warnings.append(
            f"{Ledger(sglang.site).state_dir} is not writable: `sm120kit status` and `unpatch` find the tables "
            f"in {config_dir} only with {CONFIG_DIR_ENV}={config_dir} set in their environment"
        )
    return result


@contextlib.contextmanager
def _read_only_hint(config_dir: Path | None) -> Iterator[None]:
    """A read-only package (an image layer, a venv of another owner) can still be served
    tuned tables: from a config dir."""
    try:
        yield
    except ReadOnly as exc:
        if config_dir is not None:
            raise
        raise UserError(
            exc.message,
            f"install them in a directory of your own (`sm120kit tune-moe PROFILE --config-dir DIR`, with "
            f"{CONFIG_DIR_ENV}=DIR in the profile's env), or tune where the environment is writable",
        ) from None


@contextlib.contextmanager
def _locked(target: Target, sites: set[Path], config_dir: Path | None) -> Iterator[list[str]]:
    """The lock of every site, and what a killed run left there finished first: in a config
    dir, or in the target when its journal names only tables (one that names patched files
    is for `patch` or `unpatch` to finish: they know the patches)."""
    with contextlib.ExitStack() as stack:
        recovered: list[str] = []
        for site in sorted(sites):
            stack.enter_context(Ledger(site).locked())
            if site != config_dir and not _only_tables(transaction.journal_path(site)):
                raise UserError(
                    f"an interrupted sm120kit run left {transaction.journal_path(site)}; nothing was written",
                    "run `sm120kit patch` or `sm120kit unpatch` to finish it, then tune again",
                )
            recovered += transaction.recover(site, functools.partial(_resolve_table, target, site))
        yield recovered


def _resolve_table(target: Target, site: Path, package: str, relpath: str) -> Path | None:
    """A journal's file in `site`, as a run that declares no patched files resolves it."""
    return writing.resolve(target, set(), site, package, relpath)


def _only_tables(journal: Path) -> bool:
    """No journal, or one whose files are all config tables."""
    try:
        files = shallow_json.loads(journal.read_text())["files"]
        return all(is_table_path(str(f["path"]), "package") for f in files)
    except FileNotFoundError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _sglang(target: Target) -> Distribution:
    sglang = target.find(PACKAGE)
    if sglang is None:
        raise UserError(
            f"sglang is not installed in {target.description}: there is nowhere to install MoE configs for",
            "point at the serving environment: --python EXE or --site DIR",
        )
    return sglang


def _check_table(table: Table, sglang: Distribution, triton: str | None) -> None:
    meta = table.meta
    name = meta.shape.model or f"E={meta.shape.experts},N={meta.shape.shard}"
    if meta.sglang_version != sglang.version or (triton is not None and meta.triton_version != triton):
        installed = f"sglang {sglang.version}" + (f" / Triton {triton}" if triton else "")
        raise UserError(
            f"the table for {name} was tuned for sglang {meta.sglang_version} / Triton {meta.triton_version}, "
            f"but {installed} is installed; nothing was written",
            f"re-run `sm120kit tune-moe {meta.profile or 'PROFILE'}`",
        )
    _check_configs(table.configs, name)


def _config_dir(path: Path, sglang: Distribution) -> Path:
    """A config dir the server can be given: absolute (sglang joins it as it is, so a
    relative one would be read from the server's working directory), a directory."""
    if not path.is_absolute():
        raise UserError(
            f"{CONFIG_DIR_ENV} {path}: not an absolute path (sglang would read it from the server's "
            "working directory); nothing was written",
            f"give the absolute path: {Path(path).absolute()}",
        )
    path = Path(os.path.normpath(path))
    if path.exists() and not path.is_dir():
        raise UserError(f"{CONFIG_DIR_ENV} {path}: not a directory; nothing was written", "give a directory")
    if path.resolve() == sglang.site.resolve():
        raise UserError(
            f"{CONFIG_DIR_ENV} {path} is the site directory itself",
            "give a directory of its own, e.g. /srv/moe-configs",
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReadOnly(path, exc) from None
    return path


def _can_write(state_dir: Path) -> bool:
    where = state_dir if state_dir.exists() else state_dir.parent
    return os.access(where, os.W_OK)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class _Plan:
    """The writes and ledger entries of one install, checked before any is made."""

    def __init__(self, sglang: Distribution, config_dir: Path | None, ledger: Ledger, force: bool) -> None:
        self.sglang, self.config_dir, self.ledger, self.force = sglang, config_dir, ledger, force
        self.root = "config-dir" if config_dir is not None else "package"
        self.writes: dict[Path, transaction.FileWrite] = {}
        self.tables: list[str] = []  # the ledger keys of the tuned tables, in order
        self.copied: list[Path] = []
        self.removed: list[Path] = []
        self.destinations: dict[str, Path] = {}  # key -> where the lookup looks first

    def add(self, table: Table) -> None:
        meta = table.meta
        dest = config_destination(
            self.sglang, meta.shape, meta.device_name, meta.triton_version, config_dir=self.config_dir, down=meta.down
        )
        relpath, path = self._place(dest)
        key = f"{PACKAGE}:{relpath}"
        data = table_bytes(table.configs)
        before = read_table_file(path)
        now = _now()
        entry = TunedEntry(
            package=PACKAGE,
            version=self.sglang.version,
            path=relpath,
            root=self.root,
            kind="tuned",
            triton_version=meta.triton_version,
            device_name=meta.device_name,
            vendor_sha256=self._vendor(key, relpath, path, before),
            written_sha256=sha256(data),
            shape={**meta.shape.to_json(), "block_shape": list(block) if (block := meta.shape.block_shape) else None},
            down=meta.down,
            batch_sizes=sorted(table.configs),
            profile=meta.profile,
            tuned_at=meta.tuned_at or now,
            installed_at=now,
        )
        if key in self.tables:
            raise ValueError(f"two tables for {path}")
        self.ledger.tuned[key] = entry
        self.tables.append(key)
        self.destinations[key] = dest
        if before != data:
            self.writes[path] = transaction.FileWrite(self.ledger.site, PACKAGE, relpath, path, before, data)

    def _place(self, dest: Path) -> tuple[str, Path]:
        """(the path relative to the root, the path to write) of the lookup's first choice."""
        if self.config_dir is not None:
            relpath = os.path.relpath(dest, self.config_dir).replace(os.sep, "/")
            path = self.config_dir / relpath
        else:
            module_relpath, module = config_module(self.sglang)
            inner = os.path.relpath(dest, os.path.realpath(module.parent)).replace(os.sep, "/")
            relpath = f"{module_relpath.rsplit('/', 1)[0]}/{inner}"
            path = self.sglang.file(relpath)
        if not is_table_path(relpath, self.root) or (self.config_dir is None and not writing.inside(self.sglang, path)):
            raise UserError(
                f"sglang {self.sglang.version} looks for the table at {dest}, which is not a configs/triton_*/ "
                "file of its MoE layers: its lookup is not the one sm120kit knows; nothing was written",
                "install a release sm120kit knows (0.5.9-0.5.23)",
            )
        return relpath, path

    def _vendor(self, key: str, relpath: str, path: Path, before: bytes | None) -> str:
        """The digest of the bytes unpatch must put back ("" for none), or UserError for a
        file that is neither sglang's nor ours (unless --force)."""
        old = self.ledger.tuned.get(key)
        if before is None:  # (an upgrade may have taken a file we replaced: it stays gone)
            return ""
        digest = sha256(before)
        if old and digest == old.written_sha256:
            return old.vendor_sha256  # ours: what we replaced the first time stays the original
        recorded = self.sglang.recorded_sha256(relpath) if self.root == "package" else None
        editable = self.root == "package" and self.sglang.editable_root is not None and old is None
        if digest == recorded or editable or self.force:
            return digest
        whose = "neither sglang's (RECORD) nor" if self.root == "package" else "not"
        raise UserError(
            f"{path} exists and is {whose} the table sm120kit last wrote there: someone put it there "
            "(sglang's own tuning script?); nothing was written",
            "move it aside, or pass --force to replace it (`sm120kit unpatch` puts it back)",
        )

    def mirror(self, config_dir: Path, device_names: set[str]) -> None:
        """Copy sglang's own tables for these GPUs into config_dir (the lookup reads
        nothing else once $SGLANG_MOE_CONFIG_DIR is set); take out copies of another release's
        tables that this one does not ship. A file of someone else's there is left alone."""
        module_relpath, module = config_module(self.sglang)
        ours = set(Ledger.load(self.sglang.site).tuned) if self.sglang.editable_root else set()
        shipped = {}
        for f in sorted((module.parent / "configs").glob("triton_*/*.json")):
            relpath = f"configs/{f.parent.name}/{f.name}"
            in_package = f"{module_relpath.rsplit('/', 1)[0]}/{relpath}"
            recorded = self.sglang.recorded_sha256(in_package)
            # sglang's own bytes only: not a table tuned into the package, not someone's file
            own = sha256(f.read_bytes()) == recorded if recorded else f"{PACKAGE}:{in_package}" not in ours
            if (
                own
                and (recorded or self.sglang.editable_root)
                and any(table_for_device(f.name, d) for d in device_names)
            ):
                shipped[relpath] = f
        for relpath, source in shipped.items():
            key, path = f"{PACKAGE}:{relpath}", config_dir / relpath
            old = self.ledger.tuned.get(key)
            if key in self.tables or (old and old.kind == "tuned"):
                continue  # a tuned table takes its place
            before, data = read_table_file(path), source.read_bytes()
            if before is not None and not (old and sha256(before) == old.written_sha256):
                continue  # not ours
            self.ledger.tuned[key] = TunedEntry(
                package=PACKAGE,
                version=self.sglang.version,
                path=relpath,
                root="config-dir",
                kind="shipped",
                triton_version=source.parent.name.removeprefix("triton_").replace("_", "."),
                device_name=next(d for d in device_names if table_for_device(source.name, d)),
                vendor_sha256="",
                written_sha256=sha256(data),
                installed_at=_now(),
            )
            if before != data:
                self.writes[path] = transaction.FileWrite(self.ledger.site, PACKAGE, relpath, path, before, data)
                self.copied.append(path)
        for key, old in list(self.ledger.tuned.items()):
            if old.kind != "shipped" or old.path in shipped or old.device_name not in device_names:
                continue
            path = config_dir / old.path
            before = read_table_file(path)
            if before is not None and sha256(before) != old.written_sha256:
                continue  # changed since: left alone, and still recorded
            del self.ledger.tuned[key]
            if before is not None:
                self.writes[path] = transaction.FileWrite(self.ledger.site, PACKAGE, old.path, path, before, None)
                self.removed.append(path)

    def prove(self, tables: Sequence[Table]) -> None:
        """Run the release's lookup on the files as they will be: each table must come back
        from its own file, and a lookup that finds nothing must not fail (0.5.12+ lists
        every triton_* directory then)."""
        overlay = {w.path: w.after for w in self.writes.values()}
        env = server_env(self.config_dir)
        for key, table in zip(self.tables, tables):
            meta, dest = table.meta, self.destinations[key]
            loaded = what_sglang_loads(
                self.sglang, meta.shape, meta.device_name, meta.triton_version, env, down=meta.down, overlay=overlay
            )
            if loaded is None or Path(os.path.realpath(loaded.path)) != Path(os.path.realpath(dest)):
                found = f"loads {loaded.path}" if loaded else "finds no table"
                raise UserError(
                    f"with the table written to {dest}, sglang {self.sglang.version}'s lookup {found}: "
                    "sm120kit does not know this lookup; nothing was written",
                    "report it with this message",
                )
            if loaded.table != dict(table.configs):
                raise UserError(f"sglang {self.sglang.version} reads {dest} back differently; nothing was written")
        if tables:
            unknown = replace(tables[0].meta.shape, experts=1, shard=1)  # a shape nobody has tuned
            meta = tables[0].meta
            what_sglang_loads(self.sglang, unknown, meta.device_name, meta.triton_version, env, overlay=overlay)

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
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import enum
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from sm120kit import shallow_json
from sm120kit.errors import UserError
from sm120kit.patching import transaction, writing
from sm120kit.patching.ledger import Ledger, ReadOnly, TunedEntry, is_table_path, sha256
from sm120kit.target import Distribution, Target, reinstall_command
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

PACKAGE = "sglang"
CHANGE = "tune-moe"  # what unpatch's rows name as the change they take out
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


class TableState(str, enum.Enum):
    """Whose bytes an installed table's file holds."""

    OURS = "installed"  # what sm120kit wrote
    VENDOR = "vendor"  # sglang's own file is back (an upgrade or a reinstall): the table is gone
    ABSENT = "absent"  # the file is gone
    FOREIGN = "foreign-edit"  # changed since sm120kit wrote it


@dataclass
class InstalledTable:
    """One ledger entry of a table, and what the installed sglang makes of it."""

    entry: TunedEntry
    path: Path
    config_dir: Path | None  # None: in the package
    state: TableState
    installed_sglang: str | None
    installed_triton: str | None
    loaded: Path | None = None  # the file the installed sglang loads for this shape on that GPU
    lookup_error: str = ""  # why that could not be told
    backup_missing: bool = False  # the file it replaced cannot be put back

    @property
    def stale(self) -> bool:
        """Tuned for another sglang or Triton than the installed ones."""
        return self.entry.version != self.installed_sglang or (
            self.installed_triton is not None and self.entry.triton_version != self.installed_triton
        )

    @property
    def loads_it(self) -> bool:
        """The installed sglang loads this very file for its shape on its GPU."""
        return self.loaded is not None and os.path.realpath(self.loaded) == os.path.realpath(self.path)

    @property
    def retune(self) -> str:
        return f"re-run `sm120kit tune-moe {self.entry.profile or 'PROFILE'}`"

    @property
    def note(self) -> str:
        """What status and patch --verify say about it."""
        e = self.entry
        if e.kind == "shipped":
            return f"sglang {e.version}'s own table for this GPU, copied so that ${CONFIG_DIR_ENV} keeps it in reach"
        if self.state is TableState.VENDOR:
            return f"sglang's own file is back (an upgrade or a reinstall): the tuned table is gone; {self.retune}"
        if self.state is TableState.ABSENT:
            return f"the file is gone; {self.retune}"
        if self.state is TableState.FOREIGN:
            return "changed since sm120kit wrote it: `sm120kit unpatch` leaves it alone unless --force"
        if self.stale:
            triton = f" / Triton {self.installed_triton}" if self.installed_triton else ""
            return (
                f"tuned for sglang {e.version} / Triton {e.triton_version}; installed is sglang "
                f"{self.installed_sglang or 'none'}{triton}: {self.retune}"
            )
        if self.lookup_error:
            return f"could not run sglang's lookup: {self.lookup_error}"
        if not self.loads_it:
            what = f"loads {self.loaded}" if self.loaded else "finds no table (its default config)"
            return f"sglang {self.installed_sglang} does not load it: it {what}; {self.retune}"
        return f"sglang {self.installed_sglang} loads it on {e.device_name}"

    def as_json(self) -> dict:
        e = self.entry
        return {
            "path": str(self.path),
            "root": e.root,
            "config_dir": str(self.config_dir) if self.config_dir else None,
            "kind": e.kind,
            "sglang_version": e.version,
            "triton_version": e.triton_version,
            "device_name": e.device_name,
            "shape": e.shape,
            "down": e.down,
            "batch_sizes": e.batch_sizes,
            "profile": e.profile,
            "tuned_at": e.tuned_at,
            "installed_at": e.installed_at,
            "replaced_vendor_file": bool(e.vendor_sha256),
            "sha256": e.written_sha256,
            "state": self.state.value,
            "installed_sglang": self.installed_sglang,
            "installed_triton": self.installed_triton,
            "stale": self.stale,
            "loaded_by_sglang": str(self.loaded) if self.loaded else None,
            "note": self.note,
        }


@dataclass
class Installed:
    """What install_tables did."""

    tables: list[InstalledTable]
    copied: list[Path] = field(default_factory=list)  # sglang's own tables copied into the config dir
    removed: list[Path] = field(default_factory=list)  # copies of another release's tables taken out
    warnings: list[str] = field(default_factory=list)
    server_env: dict[str, str] = field(default_factory=dict)  # what the server's environment must carry


@dataclass
class Inventory:
    """Every table the target's ledgers record: the package's and each config dir's."""

    tables: list[InstalledTable] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # a damaged config dir ledger, an unfinished run
    notes: list[str] = field(default_factory=list)  # a config dir that is not there (a volume not mounted)


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
            plan.mirror({t.meta.device_name for t in tables})
        plan.prove(tables)
        if pointer and str(config_dir) not in ledgers[sglang.site].moe_config_dirs:
            ledgers[sglang.site].moe_config_dirs.append(str(config_dir))
        writes = list(plan.writes.values())
        if writes or any(ledger.changed for ledger in ledgers.values()):
            writing.write(ledgers, writes, CHANGE)
    result = Installed(
        [_state(sglang, triton, plan.ledger, key, config_dir) for key in plan.tables],
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
            recovered += transaction.recover(
                site, lambda package, relpath, site=site: writing.resolve(target, set(), site, package, relpath)
            )
        yield recovered


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


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}", "run as a user that can read it") from None


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
        before = _read(path)
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

    def mirror(self, device_names: set[str]) -> None:
        """Copy sglang's own tables for these GPUs into the config dir (the lookup reads
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
            key, path = f"{PACKAGE}:{relpath}", self.config_dir / relpath
            old = self.ledger.tuned.get(key)
            if key in self.tables or (old and old.kind == "tuned"):
                continue  # a tuned table takes its place
            before, data = _read(path), source.read_bytes()
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
            path = self.config_dir / old.path
            before = _read(path)
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


# -- what is installed ---------------------------------------------------------------------


def config_dirs(target: Target, env: Mapping[str, str] | None = None) -> list[Path]:
    """The config dirs whose tables belong to this target: those its ledger points to, and
    $SGLANG_MOE_CONFIG_DIR of `env` (this process's environment by default)."""
    env = os.environ if env is None else env
    sglang = target.find(PACKAGE)
    dirs = list(Ledger.load(sglang.site).moe_config_dirs) if sglang else []
    if (here := env.get(CONFIG_DIR_ENV)) and os.path.isabs(here):
        dirs.append(os.path.normpath(here))
    return [Path(d) for d in dict.fromkeys(dirs)]


def inventory(target: Target, env: Mapping[str, str] | None = None) -> Inventory:
    """Every table recorded for the target, with its state and what the installed sglang
    loads in its place. Reads only; a damaged config dir ledger is a problem, not an error."""
    result = Inventory()
    sglang = target.find(PACKAGE)
    if sglang is None:
        return result
    triton = installed_triton_version(target)
    try:
        ledgers = [(Ledger.load(sglang.site), None)]
        directories = config_dirs(target, env)
    except UserError:  # the target's ledger is damaged: planning reports it
        return result
    pointed = set(ledgers[0][0].moe_config_dirs)
    for directory in directories:
        if not Ledger(directory).state_dir.is_dir():  # $SGLANG_MOE_CONFIG_DIR of no tune-moe's
            if str(directory) in pointed:
                result.notes.append(f"{directory}: the MoE config dir is not there (a volume not mounted?)")
            continue
        try:
            ledgers.append((Ledger.load(directory), directory))
        except UserError as exc:
            result.problems.append(str(exc).splitlines()[0])
    for ledger, directory in ledgers:
        if directory is not None:
            result.problems += [
                f"an interrupted sm120kit run left {j}: run `sm120kit unpatch` or `sm120kit tune-moe` to finish it"
                for j in transaction.pending([directory])
            ]
        result.tables += [_state(sglang, triton, ledger, key, directory) for key in sorted(ledger.tuned)]
    return result


def installed_tables(target: Target, env: Mapping[str, str] | None = None) -> list[InstalledTable]:
    return inventory(target, env).tables


def _entry_path(sglang: Distribution | None, ledger: Ledger, entry: TunedEntry) -> Path:
    """Where an entry's file is: inside its root (no symbolic link out), or the ledger is damaged."""
    if entry.root == "package" and sglang is not None and sglang.site == ledger.site:
        path = sglang.file(entry.path)
        inside = writing.inside(sglang, path)
    else:
        path = ledger.site / entry.path
        inside = path.parent.resolve().is_relative_to(ledger.site.resolve())
    if not inside:
        raise ledger.damaged(f"{entry.path} resolves to {path.resolve()}, outside {ledger.site}")
    return path


def _file_state(sglang: Distribution | None, entry: TunedEntry, data: bytes | None) -> TableState:
    if data is None:
        return TableState.ABSENT
    digest = sha256(data)
    if digest == entry.written_sha256:
        return TableState.OURS
    recorded = sglang.recorded_sha256(entry.path) if sglang and entry.root == "package" else None
    if digest in (recorded, entry.vendor_sha256):
        return TableState.VENDOR
    return TableState.FOREIGN


def _state(
    sglang: Distribution, triton: str | None, ledger: Ledger, key: str, config_dir: Path | None
) -> InstalledTable:
    entry = ledger.tuned[key]
    path = _entry_path(sglang, ledger, entry)
    table = InstalledTable(
        entry, path, config_dir, _file_state(sglang, entry, _read(path)), sglang.version, triton or None
    )
    table.backup_missing = bool(entry.vendor_sha256) and ledger.backup(entry.vendor_sha256) is None
    if entry.kind == "tuned" and table.state is TableState.OURS and not table.stale:
        try:
            loaded = what_sglang_loads(
                sglang, _shape(entry.shape), entry.device_name, triton or entry.triton_version,
                server_env(config_dir), down=entry.down,
            )  # fmt: skip
            table.loaded = loaded.path if loaded else None
        except UserError as exc:
            table.lookup_error = str(exc).splitlines()[0]
    return table


def _shape(recorded: dict) -> MoeShape:
    known = {k: v for k, v in recorded.items() if k in MoeShape.__dataclass_fields__}
    block = known.get("block_shape")
    return MoeShape(**{**known, "block_shape": tuple(block) if block else None})


def verify_tables(target: Target, env: Mapping[str, str] | None = None) -> tuple[list[str], list[str]]:
    """For `patch --verify`: (problems: a table whose bytes are not the ones recorded, a
    backup unpatch needs that is gone, a damaged config dir ledger; notes: tables tuned for
    another sglang or Triton, or lost to an upgrade, each saying to re-tune)."""
    found = inventory(target, env)
    problems, notes = list(found.problems), list(found.notes)
    for t in found.tables:
        if t.state is TableState.FOREIGN:
            problems.append(f"{t.path}: the bytes on disk are not the ones sm120kit recorded ({t.note})")
        elif t.backup_missing and t.state is TableState.OURS:
            problems.append(f"{t.path}: the backup of the file it replaced is missing, so `unpatch` cannot restore it")
        elif t.entry.kind == "tuned" and (t.stale or t.state is not TableState.OURS or not t.loads_it):
            notes.append(f"{t.path.name}: {t.note}")
    return problems, notes


def server_env_problem(env: Mapping[str, str], config_dir: Path | None) -> str | None:
    """What is wrong with a server environment (a profile's env) for tables installed in
    `config_dir` (None: in the package), or None: sglang reads $SGLANG_MOE_CONFIG_DIR alone
    when it is set, so it must name exactly the config dir, or be unset for the package."""
    have = env.get(CONFIG_DIR_ENV)
    if config_dir is None:
        if have:
            return (
                f"the server's environment sets {CONFIG_DIR_ENV}={have}: sglang would not read tables "
                f"installed in the package; install them there instead (--config-dir {have})"
            )
        return None
    if not have:
        return f"the server's environment does not set {CONFIG_DIR_ENV}: sglang would not read {config_dir}"
    if os.path.normpath(have) != os.path.normpath(str(config_dir)):
        return f"the server's environment sets {CONFIG_DIR_ENV}={have}, not {config_dir}"
    return None


# -- unpatch -------------------------------------------------------------------------------


def removal_sites(target: Target) -> set[Path]:
    """The sites whose ledgers unpatch must take tables out of (locked with the others)."""
    sglang = target.find(PACKAGE)
    if sglang is None:
        return set()
    sites = {sglang.site}
    for directory in config_dirs(target):
        if Ledger(directory).state_dir.is_dir():
            sites.add(directory)
    return sites


@dataclass
class Removal:
    """What unpatch does to one table's file: a row of its table (package, version, path,
    outcome, detail; `error` when it cannot), the write, and whether the entry goes."""

    path: str
    outcome: str  # one of revert.RestoreOutcome's values
    detail: str
    write: transaction.FileWrite | None = None
    forget: bool = False


def plan_removal(target: Target, ledgers: Mapping[Path, Ledger], force: bool) -> tuple[list[Removal], list[str]]:
    """The tables of every ledger taken out: a file that was new is removed, a file of
    sglang's that a table replaced is put back from the backup (proven against RECORD),
    one changed since is a foreign edit (unless `force`). Updates the ledgers (entries and
    the pointers to config dirs left empty) as they will be written. (the removals, what
    the user must do: a server environment that still names an emptied config dir)"""
    sglang = target.find(PACKAGE)
    removals: list[Removal] = []
    warnings: list[str] = []
    for ledger in ledgers.values():
        had = bool(ledger.tuned)
        for key, entry in sorted(ledger.tuned.items()):
            removal = _remove(sglang, ledger, entry, force)
            removals.append(removal)
            if removal.forget:
                del ledger.tuned[key]
        if had and not ledger.tuned and (sglang is None or ledger.site != sglang.site):
            warnings.append(
                f"{ledger.site} holds no MoE config tables now: take {CONFIG_DIR_ENV}={ledger.site} out of the "
                "profile's env, or sglang finds none (its configs/ directory stays: 0.5.12+ fails without it)"
            )
    for ledger in ledgers.values():
        ledger.moe_config_dirs = [
            d for d in ledger.moe_config_dirs if (held := ledgers.get(Path(d))) is None or held.tuned
        ]
    return removals, warnings


def _remove(sglang: Distribution | None, ledger: Ledger, entry: TunedEntry, force: bool) -> Removal:
    path = _entry_path(sglang, ledger, entry)
    shown = str(path) if entry.root == "config-dir" else entry.path
    current = _read(path)
    state = _file_state(sglang, entry, current)
    if state is TableState.ABSENT:
        return Removal(shown, "pristine", "the file is gone: nothing to remove", forget=True)
    if state is TableState.VENDOR:
        return Removal(shown, "pristine", "already sglang's own bytes (reinstalled or upgraded)", forget=True)
    if state is TableState.FOREIGN and not force:
        return Removal(
            shown, "foreign-edit", f"{path.name} changed since sm120kit wrote it; pass --force to take it out anyway"
        )
    if not entry.vendor_sha256:
        what = "the copy of sglang's own table" if entry.kind == "shipped" else "the tuned table"
        write = transaction.FileWrite(ledger.site, PACKAGE, entry.path, path, current, None)
        return Removal(shown, "would-restore", f"{what} removed (no file was there before)", write, forget=True)
    original = ledger.backup(entry.vendor_sha256)
    if original is None:
        reinstall = reinstall_command(PACKAGE, entry.version)
        return Removal(
            shown, "no-backup", f"the backup {entry.vendor_sha256[:12]} of the file it replaced is gone; {reinstall}"
        )
    recorded = sglang.recorded_sha256(entry.path) if sglang and entry.root == "package" else None
    proof = "matches the wheel's RECORD" if sha256(original) == recorded else "the bytes it replaced"
    write = transaction.FileWrite(ledger.site, PACKAGE, entry.path, path, current, original)
    return Removal(shown, "would-restore", f"the tuned table out, sglang's own file back ({proof})", write, True)

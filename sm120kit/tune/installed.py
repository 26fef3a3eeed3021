"""Tuned fused-MoE config tables as the ledgers record them (the target's and each config
dir's, see install.py): whose bytes each file holds now and what the installed sglang loads
in its place. What `status` lists and `patch --verify` checks; install reports its tables
this way and unpatch (removal.py) reads their files through it."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sm120kit.errors import UserError
from sm120kit.patching import transaction, writing
from sm120kit.patching.ledger import Ledger, TunedEntry, sha256
from sm120kit.target import Distribution, Target
from sm120kit.tune.lookup import CONFIG_DIR_ENV, installed_triton_version, server_env, what_sglang_loads
from sm120kit.tune.shape import MoeShape

PACKAGE = "sglang"
CHANGE = "tune-moe"  # what the ledger's writes and unpatch's rows name as the change


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
class Inventory:
    """Every table the target's ledgers record: the package's and each config dir's."""

    tables: list[InstalledTable] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # a damaged config dir ledger, an unfinished run
    notes: list[str] = field(default_factory=list)  # a config dir that is not there (a volume not mounted)


def read_table_file(path: Path) -> bytes | None:
    """The file's bytes; None when it is not there."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}", "run as a user that can read it") from None


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
        ledgers: list[tuple[Ledger, Path | None]] = [(Ledger.load(sglang.site), None)]
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
    for ledger, config_dir in ledgers:
        if config_dir is not None:
            result.problems += [
                f"an interrupted sm120kit run left {j}: run `sm120kit unpatch` or `sm120kit tune-moe` to finish it"
                for j in transaction.pending([config_dir])
            ]
        result.tables += [installed_table(sglang, triton, ledger, key, config_dir) for key in sorted(ledger.tuned)]
    return result


def installed_tables(target: Target, env: Mapping[str, str] | None = None) -> list[InstalledTable]:
    return inventory(target, env).tables


def entry_path(sglang: Distribution | None, ledger: Ledger, entry: TunedEntry) -> Path:
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


def file_state(sglang: Distribution | None, entry: TunedEntry, data: bytes | None) -> TableState:
    if data is None:
        return TableState.ABSENT
    digest = sha256(data)
    if digest == entry.written_sha256:
        return TableState.OURS
    recorded = sglang.recorded_sha256(entry.path) if sglang and entry.root == "package" else None
    if digest in (recorded, entry.vendor_sha256):
        return TableState.VENDOR
    return TableState.FOREIGN


def installed_table(
    sglang: Distribution, triton: str | None, ledger: Ledger, key: str, config_dir: Path | None
) -> InstalledTable:
    entry = ledger.tuned[key]
    path = entry_path(sglang, ledger, entry)
    table = InstalledTable(
        entry, path, config_dir, file_state(sglang, entry, read_table_file(path)), sglang.version, triton or None
    )
    table.backup_missing = bool(entry.vendor_sha256) and ledger.backup(entry.vendor_sha256) is None
    if entry.kind == "tuned" and table.state is TableState.OURS and not table.stale:
        try:
            if entry.shape is None:  # every tuned entry records its shape
                raise ledger.damaged(f"{key} records no shape")
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

"""Where the installed sglang looks for a fused-MoE config table, answered by its own code.

`get_config_file_name` and `get_moe_configs` are read from the installed release's
fused_moe_triton_config.py with ast and run with stand-ins for what that module imports:
the GPU's name, the target's Triton version, the server's environment
($SGLANG_MOE_CONFIG_DIR) and a view of the filesystem that may hold files not written yet.
Nothing of sglang, torch or Triton is imported, and nothing here restates their rules: the
file name, the directory, the fallback to other `triton_*` directories (a fixed list up to
0.5.11, every directory on disk newest-first from 0.5.12) are what the release computes.
"""

from __future__ import annotations

import ast
import builtins
import functools
import io
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sm120kit.errors import UserError
from sm120kit.target import Distribution, Target
from sm120kit.tune.shape import MoeShape

# The module that holds the lookup, newest layout first: moe_runner/triton_utils/ from 0.5.11,
# fused_moe_triton/ up to 0.5.10.post1. Its configs/ directory is beside it.
CONFIG_MODULES = (
    "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py",
    "sglang/srt/layers/moe/fused_moe_triton/fused_moe_triton_config.py",
)
LOOKUP_FUNCTIONS = ("get_config_file_name", "get_moe_configs")
CONFIG_DIR_ENV = "SGLANG_MOE_CONFIG_DIR"


@dataclass(frozen=True)
class Loaded:
    """The table the release's get_moe_configs returns, and the file it read it from."""

    path: Path
    table: dict[int, dict]
    first_choice: Path  # where it looked first (config_destination's answer)
    messages: tuple[str, ...] = ()  # what sglang logs on the way (the fallback warning, for one)

    @property
    def fallback(self) -> bool:
        """Not its first choice: another Triton version's table (sglang warns that it may be
        sub-optimal), or 0.5.23's up-projection table for the down projection."""
        return self.path != self.first_choice


def config_module(sglang: Distribution) -> tuple[str, Path]:
    """(its path relative to the install root, where it is) of the release's lookup module."""
    for relpath in CONFIG_MODULES:
        path = sglang.file(relpath)
        if path.is_file():
            return relpath, path
    raise UserError(
        f"sglang {sglang.version} in {sglang.site} has no fused_moe_triton_config.py "
        f"(looked for {' and '.join(CONFIG_MODULES)}): its MoE config lookup moved",
        "check sglang's fused-MoE layout for this release, or install a release sm120kit knows (0.5.9-0.5.23)",
    )


def installed_triton_version(target: Target) -> str | None:
    """The Triton version the target's `import triton` gives (from its dist-info)."""
    for name in ("triton", "pytorch-triton"):
        if dist := target.find(name):
            return dist.version
    return None


def config_file_name(sglang: Distribution, shape: MoeShape, device_name: str, *, down: bool = False) -> str:
    """The file name the release gives `shape`'s table on this GPU (torch.cuda.get_device_name())."""
    lookup = _Lookup(sglang, device_name, "0.0.0", {}, _Files(blank=True))
    return lookup.call("get_config_file_name", *_name_args(shape), down_moe=down)


def config_destination(
    sglang: Distribution,
    shape: MoeShape,
    device_name: str,
    triton_version: str,
    *,
    config_dir: Path | None = None,
    down: bool = False,
) -> Path:
    """Where a tuned table must be written so that the release loads it before anything
    else: the first path its get_moe_configs tries, with every file absent
    (`<root>/configs/triton_<version>/<name>`, root being the module's directory or
    `config_dir` as $SGLANG_MOE_CONFIG_DIR)."""
    files = _Files(blank=True)
    _Lookup(sglang, device_name, triton_version, server_env(config_dir), files).get_moe_configs(shape, down)
    if not files.probed:
        raise UserError(
            f"sglang {sglang.version}'s get_moe_configs looked at no file: its lookup is not the one sm120kit knows",
            "install a release sm120kit knows (0.5.9-0.5.23)",
        )
    return Path(files.probed[0])


def what_sglang_loads(
    sglang: Distribution,
    shape: MoeShape,
    device_name: str,
    triton_version: str,
    env: Mapping[str, str] | None = None,
    *,
    down: bool = False,
    overlay: Mapping[Path, bytes | None] | None = None,
) -> Loaded | None:
    """The table the release's get_moe_configs returns for `shape` on this GPU with this
    Triton, in a server whose environment is `env` (only $SGLANG_MOE_CONFIG_DIR counts), and
    the file it came from; None when it finds none (sglang then uses its default config).
    `overlay` shows files as they will be (bytes) or gone (None) before anything is written.
    Where sglang itself would fail (0.5.12+ lists <dir>/configs, which must exist; a table
    that is not JSON), a UserError says so."""
    files = _Files(overlay=overlay or {})
    lookup = _Lookup(sglang, device_name, triton_version, dict(env or {}), files)
    table = lookup.get_moe_configs(shape, down)
    if table is None:
        return None
    return Loaded(Path(files.opened[-1]), table, Path(files.probed[0]), tuple(lookup.log.messages))


def server_env(config_dir: Path | None) -> dict[str, str]:
    """The environment a server needs for sglang to look in `config_dir` (none: the package)."""
    return {CONFIG_DIR_ENV: str(config_dir)} if config_dir is not None else {}


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


def table_for_device(name: str, device_name: str) -> bool:
    """Whether a config file name is one sglang may load on this GPU: the release builds
    `E=..,N=..,device_name=<name with _ for spaces>` and then only `,key=value` selectors,
    `_down` and `.json` (so "NVIDIA_H100" does not take NVIDIA_H100_80GB_HBM3's files)."""
    device = device_name.replace(" ", "_")
    head, sep, rest = name.partition(f",device_name={device}")
    return bool(sep) and head.startswith("E=") and re.fullmatch(r"(,[^/]*)?(_down)?\.json", rest) is not None


# -- running the release's code ------------------------------------------------------------


def _name_args(shape: MoeShape) -> tuple:
    """get_config_file_name's arguments as get_moe_configs passes them: [block_n, block_k]."""
    block_n, block_k = shape.block_shape or (0, 0)
    return shape.experts, shape.shard, shape.dtype, [block_n, block_k], shape.per_channel_quant


class _Log:
    """sglang's logger: what it says, kept."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def _say(self, msg, *args, **_kw) -> None:
        self.messages.append(str(msg) % args if args else str(msg))

    debug = info = warning = warning_once = error = _say


@dataclass
class _Files:
    """The filesystem as the lookup sees it: the real one, with `overlay` files (bytes: as
    they will be; None: gone) on top, or nothing at all (`blank`: where would it look
    first?). Records each path it was asked about and each it opened."""

    overlay: Mapping[Path, bytes | None] = field(default_factory=dict)
    blank: bool = False
    probed: list[str] = field(default_factory=list)
    opened: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:  # paths compared resolved: sglang resolves its own (realpath)
        self._files = {os.path.realpath(p): data for p, data in self.overlay.items()}

    def exists(self, path) -> bool:
        self.probed.append(str(path))
        if self.blank:
            return False
        key = os.path.realpath(path)
        if key in self._files:
            return self._files[key] is not None
        if any(f.startswith(key + os.sep) for f, data in self._files.items() if data is not None):
            return True  # a directory the overlay's files will create
        return os.path.exists(path)

    def isdir(self, path) -> bool:
        key = os.path.realpath(path)
        return not self.blank and (
            any(f.startswith(key + os.sep) for f, data in self._files.items() if data is not None)
            or os.path.isdir(path)
        )

    def listdir(self, path) -> list[str]:
        if self.blank:
            return []
        key = os.path.realpath(path)
        extra = {
            f[len(key) + 1 :].split(os.sep)[0]
            for f, data in self._files.items()
            if data is not None and f.startswith(key + os.sep)
        }
        try:
            names = set(os.listdir(path))
        except FileNotFoundError:
            if not extra:
                raise
            names = set()
        gone = {os.path.basename(f) for f, data in self._files.items() if data is None and os.path.dirname(f) == key}
        return sorted((names - gone) | extra)

    def open(self, path, mode: str = "r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            raise PermissionError(f"the lookup of sglang tried to write {path}")
        self.opened.append(str(path))
        key = os.path.realpath(path)
        if key in self._files:
            data = self._files[key]
            if data is None:
                raise FileNotFoundError(2, "No such file or directory", str(path))
            return io.BytesIO(data) if "b" in mode else io.StringIO(data.decode())
        return builtins.open(path, mode, *args, **kwargs)


class _OsPath:
    """os.path, with the questions about what exists answered by `_Files`."""

    def __init__(self, files: _Files) -> None:
        self.exists = self.isfile = files.exists
        self.isdir = files.isdir

    def __getattr__(self, name):
        return getattr(os.path, name)


class _Os:
    """os, with the server's environment and `_Files` for what exists."""

    def __init__(self, env: dict[str, str], files: _Files) -> None:
        self.environ = env
        self.path = _OsPath(files)
        self.listdir = files.listdir

    def getenv(self, key, default=None):
        return self.environ.get(key, default)

    def __getattr__(self, name):
        return getattr(os, name)


class _Lookup:
    """The release's lookup functions, defined in a namespace of stand-ins."""

    def __init__(
        self, sglang: Distribution, device_name: str, triton_version: str, env: dict[str, str], files: _Files
    ) -> None:
        self.sglang = sglang
        self.relpath, self.path = config_module(sglang)
        self.env = env
        self.log = _Log()
        off = SimpleNamespace(enable_deterministic_inference=False)
        self.namespace: dict[str, Any] = {
            "__name__": "sm120kit_sglang_moe_lookup",
            "__file__": str(self.path),  # the lookup's default root: dirname(realpath(__file__))
            "__builtins__": builtins,
            "os": _Os(env, files),
            "json": json,
            "functools": functools,
            "logging": logging,
            "open": files.open,
            "triton": SimpleNamespace(__version__=triton_version),
            "get_device_name": lambda device_id=0: device_name,
            "get_global_server_args": lambda: off,  # up to 0.5.22: deterministic inference off
            "get_exec": lambda: SimpleNamespace(deterministic=off),  # 0.5.23
            "logger": self.log,
            "_is_hip": False,
        }
        code, unknown = _compiled(str(self.path), self.path.read_bytes())
        if missing := sorted(unknown - set(self.namespace)):
            raise UserError(
                f"{self.path}: sglang {sglang.version}'s MoE config lookup uses {', '.join(missing)}, "
                "which sm120kit does not stand in for: the lookup changed",
                "install a release sm120kit knows (0.5.9-0.5.23), or report it with this message",
            )
        exec(code, self.namespace)

    def call(self, name: str, *args, **kwargs):
        try:
            return self.namespace[name](*args, **kwargs)
        except UserError:
            raise
        except Exception as exc:  # what sglang itself would raise at this lookup
            raise LookupFailed(self, name, exc) from None

    def get_moe_configs(self, shape: MoeShape, down: bool) -> dict[int, dict] | None:
        block_n, block_k = shape.block_shape or (0, 0)
        args = (shape.experts, shape.shard, shape.dtype, block_n, block_k)
        return self.call("get_moe_configs", *args, per_channel_quant=shape.per_channel_quant, down_moe=down)


class LookupFailed(UserError):
    """The release's own lookup fails in this place: the server would fail the same way."""

    def __init__(self, lookup: _Lookup, name: str, exc: Exception) -> None:
        where = lookup.env.get(CONFIG_DIR_ENV)
        reason = f"{type(exc).__name__}: {exc}"
        hint = "fix what it names, then run the command again"
        if isinstance(exc, FileNotFoundError) and where:
            hint = (
                f"sglang {lookup.sglang.version} lists {where}/configs when a table is missing there: "
                f"create that directory (mkdir -p {where}/configs) or install the tables with "
                "`sm120kit tune-moe PROFILE`, which creates it"
            )
        super().__init__(
            f"sglang {lookup.sglang.version}'s {name} ({lookup.path}) fails here, as the server would: {reason}"
            + (f" ({CONFIG_DIR_ENV}={where})" if where else ""),
            hint,
        )


@functools.lru_cache(maxsize=16)
def _compiled(filename: str, source: bytes):
    """(the code defining the lookup functions, the module-level names they use), their
    decorators (lru_cache: every call must look again) and annotations dropped."""
    tree = ast.parse(source, filename)
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in LOOKUP_FUNCTIONS]
    if {f.name for f in funcs} != set(LOOKUP_FUNCTIONS):
        raise UserError(
            f"{filename}: no {' or '.join(sorted(set(LOOKUP_FUNCTIONS) - {f.name for f in funcs}))} in it: "
            "sglang's MoE config lookup is not the one sm120kit knows",
            "install a release sm120kit knows (0.5.9-0.5.23)",
        )
    for f in funcs:
        f.decorator_list, f.returns = [], None
        for arg in ast.walk(f.args):
            if isinstance(arg, ast.arg):
                arg.annotation = None  # they name typing's names: nothing the lookup runs
    code = compile(ast.Module(body=list(funcs), type_ignores=[]), filename, "exec", dont_inherit=True)
    return code, _free_names(funcs)


def _free_names(funcs: list[ast.FunctionDef]) -> frozenset[str]:
    """The module-level names the functions read (not their own, not builtins)."""
    free: set[str] = set()
    for f in funcs:
        local = {a.arg for a in ast.walk(f) if isinstance(a, ast.arg)}  # lambdas' too
        names = [n for n in ast.walk(f) if isinstance(n, ast.Name)]
        local |= {n.id for n in names if isinstance(n.ctx, (ast.Store, ast.Del))}
        free |= {n.id for n in names if isinstance(n.ctx, ast.Load)} - local - set(dir(builtins))
    return frozenset(free - set(LOOKUP_FUNCTIONS))

"""The distinct compiles of a fit and what each gave: one unit a launch of a config (GROUP_SIZE_M
canonical), handed out smallest tiles first, so that a config containing a smaller one already
over the limit is ruled out uncompiled; and each config's `FitResult` from its launches.

Separate from fit.py (which builds the launches) and fit_workers.py (which compiles them): the
pruning is pure bookkeeping, with no process and no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FitResult:
    config: dict
    shared: int | None  # bytes of shared memory, the largest of the launches' (None: not all compiled)
    fits: bool  # every launch compiled and needs at most the limit
    error: str | None = None  # why a launch did not compile (a ptxas or compiler failure)
    launches: tuple[int | None, ...] = field(default=())  # bytes per launch (of `gemms`); None: not compiled
    at_least: int | None = None  # ruled out uncompiled: a smaller config's launch already needs this many bytes

    def to_json(self) -> dict:
        return {
            "config": self.config,
            "shared": self.shared,
            "fits": self.fits,
            "error": self.error,
            "launches": list(self.launches),
            "at_least": self.at_least,
        }


def _point(config: dict) -> tuple[int, int, int, int]:
    return config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"], config["num_stages"]


class Sweep:
    """The distinct compiles (units: one launch of one config, GROUP_SIZE_M canonical), what
    each gave, and the order they are handed out in: smallest tiles first, so that with
    `prune` the configs that contain one already over the limit are ruled out uncompiled.
    Only launches of one family are compared: the same compile inputs but for the tiles and
    the stages (e.g. even_Ks = K % BLOCK_SIZE_K == 0 splits families: with a ragged last K
    step, the GPTQ/AWQ kernel does not pipeline B, and needs less)."""

    def __init__(self, limit: int, prune: bool):
        self.limit, self.prune = limit, prune
        self.units: dict[str, tuple[dict, int]] = {}  # key -> (canonical config, launch index)
        self.family: dict[str, str] = {}  # key -> its family
        self.siblings: dict[str, list[str]] = {}  # key -> the keys of its config's launches
        self.found: dict[str, tuple[int | None, str | None]] = {}  # key -> (shared, error)
        self.ruled_out: set[str] = set()
        self.over: dict[str, list[tuple[tuple[int, int, int, int], int]]] = {}  # family -> [(point, bytes)]
        self.order: list[str] | None = None

    def add(self, config: dict, keys: list[tuple[str, str]]) -> None:
        siblings = [key for key, _ in keys]
        for index, (key, family) in enumerate(keys):
            if key not in self.units:
                self.units[key], self.family[key], self.siblings[key] = (config, index), family, siblings

    def record(self, key: str, value: tuple[int | None, str | None]) -> None:
        self.found[key] = value
        shared = value[0]
        if shared is not None and shared > self.limit:
            self.over.setdefault(self.family[key], []).append((_point(self.units[key][0]), shared))

    def bound(self, keys: list[str]) -> int | None:
        """With prune: the most bytes that a launch of the same family with smaller or equal
        tiles and stages needs, when that is over the limit (by monotonicity, the config of
        these launches needs as many), else None."""
        if not self.prune:
            return None
        sizes = [
            size
            for key in keys
            for point in [_point(self.units[key][0])]
            for smaller, size in self.over.get(self.family[key], ())
            if all(x <= y for x, y in zip(smaller, point))
        ]
        return max(sizes, default=None)

    def next_unit(self) -> str | None:
        """The next key to compile, or None; ruled-out keys are skipped (and counted)."""
        if self.order is None:
            self.order = sorted((k for k in self.units if k not in self.found), key=self._staged, reverse=True)
        while self.order:
            key = self.order.pop()
            if key in self.found:
                continue
            if self.bound(self.siblings[key]) is not None:
                self.ruled_out.add(key)
                continue
            return key
        return None

    def _staged(self, key: str) -> tuple[int, str]:
        """What a unit's tiles stage per block, as a proxy: only the order depends on it."""
        m, n, k, stages = _point(self.units[key][0])
        return (stages - 1) * (m + n) * k, key

    def retry(self, key: str) -> None:
        assert self.order is not None  # key was handed out by next_unit, which made the order
        self.order.append(key)

    def rule_out_known(self) -> None:
        """Mark what the results so far (e.g. cached ones) already rule out."""
        pending = (key for key in self.units if key not in self.found)
        self.ruled_out |= {key for key in pending if self.bound(self.siblings[key]) is not None}

    def progress(self) -> tuple[int, int]:
        return len(self.found) + len(self.ruled_out), len(self.units)

    def result(self, config: dict, keys: list[str]) -> FitResult:
        found = [self.found.get(key) for key in keys]
        sizes = tuple(value[0] if value else None for value in found)
        error = next((value[1] for value in found if value and value[1]), None)
        compiled = [size for size in sizes if size is not None]
        if len(compiled) == len(sizes):
            shared = max(compiled)
            return FitResult(dict(config), shared, error is None and shared <= self.limit, error, sizes)
        return FitResult(dict(config), None, False, error, sizes, None if error else self.bound(keys))

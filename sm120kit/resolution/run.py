"""Run probe.py in the target's interpreter: one request in, one answer out, bounded in time.

The answer is cached by what decides it: the probe's text, the sglang release and the
bytes of its server_args.py (an editable install changes without a new version), the
flags, the server's environment as sglang reads it, the capability presented and the
model's config.json bytes. A resolution that cannot run says why; the caller falls back
to the flags.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sm120kit import child_process
from sm120kit.caches import cache_dir
from sm120kit.resolution.slots import RECORD_FIELDS

PROBE = Path(__file__).with_name("probe.py")
TIMEOUT_ENV = "SM120KIT_RESOLUTION_TIMEOUT"
DEFAULT_TIMEOUT = 120.0  # seconds: sglang's import is ~7 s on an idle CPU, minutes on none
ENV_PREFIXES = ("SGLANG", "SGL_", "FLASHINFER", "CUDA", "TORCH", "NVIDIA", "NCCL", "HF_", "TRANSFORMERS", "PYTHON")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # a check never reaches the network
REDACTED = "sm120kit-redacted"  # in place of a secret: no selection reads the API key
# What sglang's own checks raise on arguments it refuses; anything else (an ImportError, an
# OSError reading the model) means the resolution could not run here.
SGLANG_REFUSALS = ("ValueError", "AssertionError", "NotImplementedError")


@dataclass(frozen=True)
class Node:
    """What the probe presents to sglang."""

    capability: str  # "12.0", "12.1"
    gpus: int = 8
    memory_mib: int = 97887  # an RTX PRO 6000 Blackwell
    name: str = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    source: str = "the profile"  # where the capability was read: NVML, --capability, the profile


@dataclass
class Resolution:
    """sglang's answer for one launch, or why there is none."""

    ok: bool
    sglang: str | None = None
    resolved: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    stage: str = ""  # where it failed: probe, import, argv, resolve, timeout
    error: str = ""
    how: str = ""  # resolve_once or __post_init__
    seconds: dict = field(default_factory=dict)
    cached: bool = False

    @property
    def rejected(self) -> bool:
        """sglang itself refuses these arguments (its argparse, or a check of its own)."""
        return self.stage == "argv" or (self.stage == "resolve" and self.error.split(":")[0] in SGLANG_REFUSALS)

    def as_json(self) -> dict:
        doc: dict = {"ok": self.ok, "sglang": self.sglang, "cached": self.cached}
        if self.ok:
            doc.update(how=self.how, notes=self.notes, seconds=self.seconds)
        else:
            doc.update(stage=self.stage, error=self.error, rejected=self.rejected)
        return doc


def flags_of(argv: list) -> list[str]:
    """sglang's flags from a rendered `python -m sglang.launch_server ...` (secrets redacted)."""
    words = [a if isinstance(a, str) else REDACTED for a in argv]
    if len(words) >= 3 and words[1] == "-m":
        return words[3:]
    return words[1:]


def _key(python: str, flags: list[str], env: dict[str, str], node: Node, sglang: str, fingerprint: str) -> str:
    config = b""
    for i, word in enumerate(flags[:-1]):
        if word == "--model-path" and (found := Path(flags[i + 1]) / "config.json").is_file():
            try:
                config = found.read_bytes()
            except OSError:
                config = b""
    relevant = sorted((k, v) for k, v in env.items() if k.startswith(ENV_PREFIXES))
    doc = [PROBE.read_text(), python, flags, relevant, node.capability, node.gpus, node.memory_mib, sglang, fingerprint]
    return hashlib.sha256(json.dumps(doc).encode() + config).hexdigest()


def resolve(
    python: str,
    argvs: list[list],
    env: dict[str, str],
    node: Node,
    sglang: str,
    fingerprint: str = "",
    timeout: float | None = None,
    use_cache: bool = True,
    fields: Sequence[str] | None = RECORD_FIELDS,
) -> list[Resolution]:
    """sglang's resolution of each rendered launch in `argvs`, in `python` with the server's
    environment `env` (on top of this one) and the node presented: one child for those not
    cached, which imports sglang once. Each answer keeps `fields` of sglang's record (None:
    all of them)."""
    full_env = {**os.environ, **env, **OFFLINE}
    flags = [flags_of(argv) for argv in argvs]
    stores = [
        cache_dir("resolution") / f"{_key(python, f, full_env, node, sglang, fingerprint + repr(fields))}.json"
        for f in flags
    ]
    answers: list[Resolution | None] = [_read_cached(s) if use_cache else None for s in stores]
    todo = [i for i, a in enumerate(answers) if a is None]
    if todo:
        limit = timeout if timeout is not None else _timeout()
        fresh = _run(python, [flags[i] for i in todo], full_env, node, limit, fields)
        for i, answer in zip(todo, fresh):
            answers[i] = answer
            if answer.ok or answer.rejected:  # a failure to run may pass; sglang's answer stays
                _write_cached(stores[i], answer)
    return [a for a in answers if a is not None]


def _timeout() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT


def _run(
    python: str, flags: list[list[str]], env: dict[str, str], node: Node, timeout: float, fields: Sequence[str] | None
) -> list[Resolution]:
    """Every launch, through as few children as it takes. The probe answers launch by
    launch: when one ends the process (sglang can exit or crash inside its own checks), the
    answers before it stand, it is answered with how the process ended, and the launches
    after it go to a new child. A child that did not import sglang, or ran out of time,
    answers the same for every launch left."""
    answers: dict[int, Resolution] = {}
    pending = list(range(len(flags)))
    while pending:
        imported, got, ended = _child(python, [flags[i] for i in pending], env, node, timeout, fields)
        answers.update({pending[k]: answer for k, answer in got.items() if 0 <= k < len(pending)})
        missing = [i for i in pending if i not in answers]
        if not missing:
            break
        if not imported or ended.stage == "timeout":
            answers.update({i: dataclasses.replace(ended) for i in missing})
            break
        answers[missing[0]] = ended  # the launch it was resolving when it ended
        pending = missing[1:]
    return [answers[i] for i in range(len(flags))]


def _child(
    python: str, flags: list[list[str]], env: dict[str, str], node: Node, timeout: float, fields: Sequence[str] | None
) -> tuple[bool, dict[int, Resolution], Resolution]:
    """One child for `flags`: (did it import sglang, the answers it gave by position, how it
    ended where it left launches unanswered)."""
    request = {"argvs": flags, "capability": node.capability, "gpus": node.gpus, "memory_mib": node.memory_mib}
    request.update(name=node.name, fields=list(fields) if fields is not None else None)
    try:  # its own group: a timeout kills sglang's children too
        child = child_process.run(
            [python, "-c", PROBE.read_text()], env=env, input=json.dumps(request), deadline_s=timeout
        )
    except OSError as exc:
        return False, {}, Resolution(False, stage="probe", error=f"cannot start {python}: {exc.strerror or exc}")
    head, got = _answers(child)
    import_seconds = head.get("import_seconds") if head else None
    for answer in got.values():
        if answer.ok:
            answer.seconds = {"import": import_seconds, "resolve": answer.seconds.get("resolve"), "wall": child.seconds}
    imported = bool(head and head.get("ok") is True)
    if child.hung:
        ended = Resolution(
            False, stage="timeout", error=f"no answer within {timeout:.0f} s (${TIMEOUT_ENV} sets the limit)"
        )
    elif head is not None and head.get("ok") is not True:
        ended = Resolution(False, stage=str(head.get("stage") or "probe"), error=str(head.get("error", ""))[:2000])
    else:
        tail = (child.stderr_tail() or [""])[-1]
        said = f"exit status {child.returncode}" + (f": {tail[:300]}" if tail else "")
        what = "ended the process" if imported else "gave no answer"
        ended = Resolution(False, stage="probe", error=f"the probe {what} ({said})")
    return imported, got, ended


def _answers(child: child_process.ChildRun) -> tuple[dict | None, dict[int, Resolution]]:
    """The probe's MARKER lines of this protocol: (its first word, the answers by index)."""
    from sm120kit.resolution.probe import MARKER, PROTOCOL

    head: dict | None = None
    got: dict[int, Resolution] = {}
    for doc in child.objects(MARKER):
        if doc.get("protocol") != PROTOCOL:
            continue
        index = doc.get("index")
        if not isinstance(index, int):
            head = head or doc
        elif head is not None and (answer := _from_json(doc, head.get("sglang"))) is not None:
            answer.seconds = {"resolve": doc.get("seconds")}
            got[index] = answer
    return head, got


def _from_json(doc: dict, sglang: object = None) -> Resolution | None:
    resolved, notes = doc.get("resolved", {}), doc.get("notes", [])
    if not (isinstance(resolved, dict) and isinstance(notes, list)):
        return None
    release = doc.get("sglang", sglang)
    seconds = doc.get("seconds")
    return Resolution(
        ok=doc.get("ok") is True,
        sglang=str(release) if release else None,
        resolved=resolved,
        notes=[str(n) for n in notes],
        stage=str(doc.get("stage", "")),
        error=str(doc.get("error", ""))[:2000],
        how=str(doc.get("how", "")),
        seconds=seconds if isinstance(seconds, dict) else {},
    )


def _read_cached(path: Path) -> Resolution | None:
    from sm120kit.shallow_json import loads  # bounded: a cache file is not trusted

    try:
        doc = loads(path.read_text())
    except (OSError, ValueError):
        return None
    found = _from_json(doc) if isinstance(doc, dict) else None
    if found is not None:
        found.cached = True
    return found


def _write_cached(path: Path, answer: Resolution) -> None:
    from sm120kit.atomic_write import write_atomic

    doc = {
        "protocol": 1,
        "ok": answer.ok,
        "sglang": answer.sglang,
        "resolved": answer.resolved,
        "notes": answer.notes,
        "stage": answer.stage,
        "error": answer.error,
        "how": answer.how,
        "seconds": answer.seconds,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(doc).encode())
    except OSError:
        pass  # a cache that cannot be written costs time, never the answer

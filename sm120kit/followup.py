"""The commands the output tells the user to run next (a `next:` line, a check's fix, a
warning), spelled for the invocation that printed them: the same target (--python EXE or
--site DIR), the same profile and the --profile-dir / --patch-dir / --set it was given,
wherever the command named accepts them. Else `status --python ENV` would say "run
`sm120kit patch`", which patches sm120kit's own interpreter.

A follow-up is written `sm120kit VERB ...` in backticks wherever it is made (the library
does not know the command line it runs under); the renderers pass what they print through
complete(), report.emit_json every string of a --json document, and command() spells one
from words. Which options a verb takes, and where its profile goes, is read from the real
parser, so a new option or command needs nothing here.
A leaf: it imports nothing of sm120kit's."""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePath

PROG = "sm120kit"
PROFILE_DESTS = ("name", "profile")  # the dest of a command's profile, positional or --profile
_IN_BACKTICKS = re.compile(r"`(sm120kit(?: [^`]*)?)`")


@dataclass(frozen=True)
class Invocation:
    """What of the running command line a follow-up repeats."""

    parser: argparse.ArgumentParser  # the whole command line's: each verb's options are read from it
    target: tuple[str, str] | None = None  # ("--python", EXE) or ("--site", DIR), as given
    profile: str | None = None
    profile_dirs: tuple[str, ...] = ()
    patch_dirs: tuple[str, ...] = ()
    sets: tuple[str, ...] = ()


def invocation_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Invocation:
    """The Invocation of parsed `args` (of `parser`, the top-level one)."""
    target = next(((f"--{o}", str(v)) for o in ("python", "site") if (v := getattr(args, o, None))), None)
    return Invocation(
        parser=parser,
        target=target,
        profile=_profile_of(args),
        profile_dirs=tuple(getattr(args, "profile_dir", None) or ()),
        patch_dirs=tuple(getattr(args, "patch_dir", None) or ()),
        sets=tuple(getattr(args, "sets", None) or ()),
    )


def _profile_of(args: argparse.Namespace) -> str | None:
    for dest in PROFILE_DESTS:
        value = getattr(args, dest, None)
        if isinstance(value, list):  # bench's PROFILE (or `bench OPTIONS compare DIR...`): one word, not `compare`
            value = value[0] if len(value) == 1 and value[0] != "compare" else None
        if isinstance(value, str) and value:
            return value
    return None


_current: Invocation | None = None


@contextlib.contextmanager
def invoked(invocation: Invocation) -> Iterator[None]:
    """Follow-ups are spelled for `invocation` meanwhile (a command run inside another, as
    `try` runs its steps, has its own)."""
    global _current
    outer, _current = _current, invocation
    try:
        yield
    finally:
        _current = outer


def command(*words: str) -> str:
    """`sm120kit WORDS...` as the running command's follow-up: its target, profile and
    directories added where the verb takes them, each word shell-quoted."""
    return _completed([PROG, *words]) or shlex.join([PROG, *words])


def complete(text: str) -> str:
    """Every `sm120kit ...` in backticks in `text` completed as command() completes one.
    One the parser does not read as a command (`sm120kit bench --vary/--variants`, a
    template with `...`) is left as it is; outside a command line, all of them are."""
    if _current is None or "`sm120kit" not in text:
        return text

    def one(match: re.Match) -> str:
        try:
            words = shlex.split(match.group(1))
        except ValueError:
            return match.group(0)
        done = _completed(words)
        return f"`{done}`" if done else match.group(0)

    return _IN_BACKTICKS.sub(one, text)


def _completed(words: list[str]) -> str | None:
    """words (`sm120kit VERB ...`) with what the invocation adds; None where the parser
    does not read them as a command (an unknown verb or option)."""
    invocation = _current
    if invocation is None:
        return shlex.join(words)
    parser, rest = invocation.parser, words[1:]
    verb: list[str] = []
    while (choices := _verbs(parser)) and rest and rest[0] in choices:
        parser = choices[rest[0]]
        verb.append(rest.pop(0))
    if not verb or ((verbs := _verb_action(parser)) is not None and verbs.required):
        return None  # no command named, or a group without its verb (`sm120kit profile`; `bench` runs without)
    read = _read(parser, rest)
    if read is None:
        return None
    given, positionals = read
    room = [a.nargs for a in parser._actions if not a.option_strings]
    if not any(n in ("*", "+", argparse.REMAINDER) for n in room) and len(positionals) > len(room):
        return None  # more words than the verb takes: prose that begins like a command
    options = {o for a in parser._actions for o in a.option_strings}
    added: list[str] = []
    same_profile = _place_profile(parser, rest, positionals, invocation.profile)
    if same_profile and "--profile" in options and "--profile" not in given:
        added += ["--profile", str(invocation.profile)]
    if "--python" in options and not given & {"--python", "--site"} and invocation.target:
        option, value = invocation.target
        if option == "--site" and _runs_the_interpreter([*verb, *(w for _, w in positionals[:1])], given):
            option, value = "--python", "EXE"  # a DIR of files has no python to run: the user names one
        added += [option, value]
    for option, values in (("--profile-dir", invocation.profile_dirs), ("--patch-dir", invocation.patch_dirs)):
        if option in options and option not in given:
            added += [w for v in values for w in (option, v)]
    if same_profile and "--set" in options and "--set" not in given:
        added += [w for v in invocation.sets for w in ("--set", v)]
    return shlex.join([PROG, *verb, *rest, *added])


def _place_profile(
    parser: argparse.ArgumentParser, rest: list[str], positionals: list[tuple[int, str]], profile: str | None
) -> bool:
    """Put the invocation's profile in the verb's profile argument (in `rest`, in place):
    where a required one is missing, written as its placeholder (NAME), or as the name it
    loaded as. Whether the command is about that profile (not a twin named on purpose, not
    a template missing an earlier argument): then it gets the profile's --set and, for
    `--profile`, the option."""
    if profile is None:
        return False
    actions = [a for a in parser._actions if not a.option_strings]
    slot = next((i for i, a in enumerate(actions) if a.dest in PROFILE_DESTS), None)
    if slot is None:
        return True  # the verb takes no profile, or takes it as --profile
    action = actions[slot]
    if slot < len(positionals):
        at, word = positionals[slot]
        if word not in (action.metavar, profile, _loaded_name(profile)):
            return False
        rest[at] = profile  # as it was typed: a profile file's name alone finds it nowhere
        return True
    if slot == len(positionals) and action.nargs is None:  # a required one, missing
        rest.insert(positionals[-1][0] + 1 if positionals else 0, profile)
        return True
    return False


def _loaded_name(profile: str) -> str:
    """The name a profile has once loaded: a path's (a .toml file) is its file's stem."""
    return PurePath(profile).stem if profile.endswith(".toml") or "/" in profile else profile


def _verb_action(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _verbs(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    found = _verb_action(parser)
    return dict(found.choices) if found else None


def _read(parser: argparse.ArgumentParser, rest: list[str]) -> tuple[set[str], list[tuple[int, str]]] | None:
    """(the options given, each positional word with its index in `rest`); None for an
    option the verb does not have, or one missing its value (prose, a template)."""
    by_option = {o: a for a in parser._actions for o in a.option_strings}
    given: set[str] = set()
    positionals: list[tuple[int, str]] = []
    value: str | None = None  # the option whose value comes next ("?": may not come)
    for i, word in enumerate(rest):
        option = word.startswith("-") and word != "-"
        if value is not None and (value != "?" or not option):
            value = None
            continue
        value = None
        if option:
            action = by_option.get(word.split("=", 1)[0])
            if action is None:
                return None
            given.update(action.option_strings)
            if action.nargs != 0 and "=" not in word:
                value = "?" if action.nargs == "?" else "required"
        else:
            positionals.append((i, word))
    return None if value == "required" else (given, positionals)


def _runs_the_interpreter(named: list[str], given: set[str]) -> bool:
    """Whether the command (its verb and first positional, as in `render systemd`) runs the
    target's python, which --site cannot give (each refuses --site then): serve but
    --dry-run, bench's sweeps, doctor's NCCL probe, tune-moe's timing, and the unit that
    `render systemd` writes (it runs serve there)."""
    match named:
        case ["serve", *_]:
            return "--dry-run" not in given
        case ["bench", first, *_]:
            return first != "compare"
        case ["bench"]:
            return True
        case ["doctor", *_]:
            return bool(given & {"--nccl", "--nccl-gpus"})
        case ["tune-moe", *_]:
            return "--plan" not in given
        case ["render", "systemd"]:
            return True
    return False

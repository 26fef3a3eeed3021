"""The values `render` writes into a systemd unit, a compose file or Kubernetes manifests,
checked before anything is rendered: a UserError (exit 2, nothing printed) naming the
option or the profile key. A control character is refused everywhere: a newline (or, for
systemd, a carriage return) in a unit starts a directive of its own (`--unit-user
$'sglang\\nExecStartPre=...'`). Names are checked as their reader checks them: User= as
systemd does, a Secret's or a claim's name as Kubernetes does."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from sm120kit.errors import UserError
from sm120kit.textcheck import control_char

if TYPE_CHECKING:
    from sm120kit.profiles.model import Profile

# systemd's valid_user_group_name() without VALID_USER_RELAX (what it accepts without a
# word; systemd 252 accepts more with "does not match strict user/group name rules"), plus
# '.' after the first character: at most 31 characters (UT_NAMESIZE - 1).
USER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,30}")
UID_INVALID = (0xFFFF, 0xFFFFFFFF)  # systemd's uid_is_valid(): (uint16_t) -1 and (uint32_t) -1
# A Kubernetes object name (a Secret, a PersistentVolumeClaim): a DNS-1123 subdomain.
K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# Fields of a profile that are not written as they are: the description becomes one line
# (systemd's Description=), the source is where the profile was read from.
NOT_WRITTEN = ("description", "source")


def plain(option: str, value: str | None) -> str | None:
    """value, when it holds no control character; else a UserError naming the option."""
    if value is not None and (bad := control_char(value)):
        raise UserError(
            f"{option} {value!r} holds {bad}: a unit, compose file or manifest would take it as the start of a "
            "new line (or not as written)",
            f"give {option} on one line, without control characters",
        )
    return value


def unit_user(value: str) -> str:
    """--unit-user as systemd's User= takes it: a user name (letters, digits, '_', '-' and
    '.', not starting with a digit, '-' or '.', at most 31 characters) or a numeric uid."""
    plain("--unit-user", value)
    numeric = value.isascii() and value.isdigit()
    if numeric and (value == "0" or not value.startswith("0")) and int(value) < 2**32 and int(value) not in UID_INVALID:
        return value
    if not numeric and USER_NAME.fullmatch(value):
        return value
    raise UserError(
        f"--unit-user {value!r} is not a user name systemd takes for User= (letters, digits, '_', '-' and '.', "
        "not starting with a digit, '-' or '.', at most 31 characters; or a numeric uid)",
        "give the account the server runs as, e.g. --unit-user sglang (`id -un` on the node names yours)",
    )


def k8s_name(option: str, value: str | None) -> str | None:
    """A Kubernetes object's name (--secret, --hf-cache-claim): a DNS-1123 subdomain."""
    if value is not None and not (len(value) <= 253 and K8S_NAME.fullmatch(value)):
        raise UserError(
            f"{option} {value!r} is not a Kubernetes object name (lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit, at most 253)",
            "give the name as kubectl lists it, e.g. kubectl get secrets,pvc",
        )
    return value


def profile_values(profile: Profile) -> None:
    """Every key and text value of the profile that a unit, compose file or manifest may
    carry (its model path, served name, env, extra_args, the router's options, ...) holds
    no control character: a UserError naming the key, otherwise."""

    def walk(value: object, where: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                inside = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and (bad := control_char(key)):
                    raise _bad_key(profile, f"{where or 'the profile'} has a key {key!r}", bad)
                walk(inner, inside)
        elif isinstance(value, (list, tuple)):
            for k, inner in enumerate(value):
                walk(inner, f"{where}[{k}]")
        elif isinstance(value, str) and (bad := control_char(value)):
            raise _bad_key(profile, f"{where} = {value!r}", bad)

    doc = profile.model_dump()
    walk({k: v for k, v in doc.items() if k not in NOT_WRITTEN}, "")


def _bad_key(profile: Profile, what: str, bad: str) -> UserError:
    return UserError(
        f"profile {profile.name} ({profile.source}): {what} holds {bad}, which a unit, compose file or "
        "manifest would take as the start of a new line (or not as written); nothing was rendered",
        "write the value on one line, without control characters (in the profile, or in --set)",
    )


def volume_path(option: str, path: str | None) -> str | None:
    """A host path that docker mounts (HOST:CONTAINER[:ro] in the run line and the compose
    file): a ':' in it would split the volume's spec."""
    if path is not None and ":" in path:
        raise UserError(
            f"{option} {path!r} holds a ':', which would split docker's HOST:CONTAINER volume spec",
            f"give {option} a directory whose path has no ':' (a symlink to it will do)",
        )
    return path

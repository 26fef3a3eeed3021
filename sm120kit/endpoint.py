"""A server's endpoint as a client on this node reaches it: the host to ask for the address
the server binds, and the API key it wants (checked before it goes into a header). Serve,
the smoke, bench and the fleet's router all need these."""

from __future__ import annotations

import os

from sm120kit.errors import UserError

KEY_CHAR_NAMES = {"\r": "a carriage return", "\n": "a newline", " ": "a space", "\t": "a tab"}


def probe_host(bind_host: str) -> str:
    """Where to reach a server bound to bind_host from this node."""
    host = bind_host.strip("[]")
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def api_key(env_name: str | None) -> str | None:
    """The key the server wants: the profile's variable; else the one sglang's client reads."""
    names = [env_name] if env_name else ["OPENAI_API_KEY", "API_KEY"]
    if env_name and not os.environ.get(env_name):
        raise UserError(
            f"the profile's server.api_key_env is {env_name}, but ${env_name} is empty or not set",
            f"export {env_name}=<the key>",
        )
    name = next((n for n in names if os.environ.get(n)), None)
    if name and (bad := bad_key_char(os.environ[name])):  # it would break the header, and the error would quote it
        raise UserError(
            f"${name} {bad}: a key is one word of printable ASCII",
            f"set it to the key alone, e.g. export {name}=\"$(tr -d ' \\t\\r\\n' < KEYFILE)\"",
        )
    return os.environ[name] if name else None


def bad_key_char(key: str) -> str | None:
    """Where and what the first character is that has no place in a bearer token (one word
    of printable ASCII): "ends with a carriage return". A key file written on another OS
    ends in \\r\\n, and a header with it made the probe raise, the key in its message."""
    for i, char in enumerate(key):
        if "!" <= char <= "~":
            continue
        what = KEY_CHAR_NAMES.get(char) or ("a non-ASCII character" if ord(char) > 0x7F else "a control character")
        where = "starts with" if i == 0 else "ends with" if i == len(key) - 1 or key[i:].strip() == "" else "contains"
        return f"{where} {what}"
    return None

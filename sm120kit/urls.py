"""The one reading of a server's URL (`smoke --url`, `bench --url`, a fleet replica's `url`)
and the one way to write one (a profile's server, a fleet's router and its replicas): an
HTTP(S) origin, http://HOST:PORT, and nothing else. A malformed URL is a ValueError
(BadUrl) that says what is wrong, or with `url_option` a UserError naming the option (exit
2); never urllib's own errors ("Invalid IPv6 URL") and never its silent repairs (urlsplit
drops a tab or a newline inside a URL: the text used afterwards would still hold it).

Imports nothing of sm120kit but errors and textcheck: the profile model, the clients and the CLI use it."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from sm120kit.errors import UserError
from sm120kit.textcheck import control_char

SCHEMES = ("http", "https")
EXAMPLE = "http://127.0.0.1:30000"
# A DNS name as resolvers take it: labels of letters, digits, '-' and '_' (container and
# cluster names), not starting or ending with '-', at most 63 each and 253 in all.
LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


class BadUrl(ValueError):
    """Not an http(s)://HOST:PORT URL; the message says why."""


@dataclass(frozen=True)
class HttpUrl:
    scheme: str  # "http" | "https"
    host: str  # a name, an IPv4 address, or an IPv6 address without its brackets
    port: int

    @property
    def text(self) -> str:
        return http_url(self.host, self.port, self.scheme)

    def __str__(self) -> str:
        return self.text


def host_problem(host: str) -> str | None:
    """Why `host` is not a host name or an IP address (an IPv6 one with or without its
    brackets); None when it is one."""
    if not isinstance(host, str) or not host:
        return "no host"
    if bad := control_char(host):
        return f"{host!r} holds {bad}: not a host"
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" in bare:
        try:
            ipaddress.IPv6Address(bare)
        except ValueError:
            return f"{host!r} is not an IPv6 address"
        return None
    if "[" in host or "]" in host:
        return f"{host!r} is not a host: brackets go around an IPv6 address only"
    name = bare[:-1] if bare.endswith(".") else bare
    if len(name) > 253 or not all(LABEL.fullmatch(label) for label in name.split(".")):
        return f"{host!r} is not a host name or an IP address"
    return None


def http_url(host: str, port: int, scheme: str = "http") -> str:
    """scheme://HOST:PORT, an IPv6 address in brackets (http://[::1]:30000, never
    http://::1:30000)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return f"{scheme}://{f'[{bare}]' if ':' in bare else bare}:{port}"


def parse_http_url(text: str) -> HttpUrl:
    """`text` as http(s)://HOST:PORT (a trailing '/' is allowed); BadUrl (a ValueError)
    saying what is wrong: no scheme or another one, user info, no host or a malformed one,
    no port or one out of range, a path, a query, a fragment, a space or a control character."""
    if not isinstance(text, str) or not text:
        raise BadUrl("it is empty")
    if bad := control_char(text) or ("a space" if " " in text else None):
        raise BadUrl(f"it holds {bad}")
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise BadUrl("it does not start with http:// or https://")
    authority, slash, path = rest.partition("/")
    if any(c in authority for c in "?#"):
        raise BadUrl("a server's URL has no query or fragment")
    if slash and path:
        raise BadUrl(f"a server's URL has no path (/{path})")
    if "@" in authority:
        raise BadUrl("a server's URL has no user or password (the API key comes from the environment)")
    if authority.startswith("["):
        close = authority.find("]")
        if close < 0:
            raise BadUrl("its IPv6 address has no closing ']'")
        host, after = authority[1:close], authority[close + 1 :]
        if after and not after.startswith(":"):
            raise BadUrl(f"{after!r} follows the IPv6 address: only :PORT may")
        port_text = after[1:] if after else None
    else:
        host, colon, port_text = authority.rpartition(":")
        if not colon:
            host, port_text = authority, None
        elif ":" in host:
            raise BadUrl("an IPv6 address goes in brackets: http://[ADDRESS]:PORT")
    if not host:
        raise BadUrl("it names no host")
    if problem := host_problem(f"[{host}]" if authority.startswith("[") else host):
        raise BadUrl(problem)
    if port_text is None or port_text == "":
        raise BadUrl("it names no port (sglang's default is 30000)")
    if not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5 and 1 <= int(port_text) <= 65535):
        raise BadUrl(f"its port {port_text!r} is not a port (1-65535)")
    return HttpUrl(scheme.lower(), host, int(port_text))


def url_option(option: str, text: str) -> str:
    """The value of a URL option (--url), as http(s)://HOST:PORT; a UserError (exit 2)
    naming the option and what is wrong."""
    try:
        return parse_http_url(text).text
    except BadUrl as exc:
        raise UserError(f"{option} {text!r} is not http://HOST:PORT: {exc}", f"e.g. {option} {EXAMPLE}") from None

#!/usr/bin/env python3
"""Fetch real release wheels from PyPI (cached) and unpack them into site directories:
a thin command line over sm120kit.wheels (the proven window, the cache, the install as
pip does it), which the tests and the other scripts import directly.

    python scripts/fetch_wheels.py sglang 0.5.10 --site ./site       # the whole wheel
    python scripts/fetch_wheels.py sglang --window                    # prefetch 0.5.9-0.5.23

The cache is $SM120KIT_WHEEL_CACHE, else ~/.cache/sm120kit/wheels (the platform's user cache dir).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sm120kit.errors import UserError
from sm120kit.wheels import SGLANG_WINDOW, FetchError, fetch, install


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", help="e.g. sglang")
    parser.add_argument("versions", nargs="*", help="releases to fetch")
    parser.add_argument("--window", action="store_true", help="every sglang release sm120kit is proven on")
    parser.add_argument("--site", type=Path, help="also install (unpack) the single release into this site dir")
    parser.add_argument("--member", action="append", help="unpack only files matching this glob (repeatable)")
    args = parser.parse_args()
    versions = list(args.versions) + (list(SGLANG_WINDOW) if args.window else [])
    if not versions:
        parser.error("name at least one version, or --window")
    if args.site and len(versions) != 1:
        parser.error("--site takes exactly one version")
    try:
        for version in versions:
            wheel = fetch(args.package, version)
            print(wheel)
            if args.site:
                dist_info = install(args.site, args.package, version, args.member)
                print(f"installed {dist_info.name} into {args.site}")
    except (FetchError, UserError) as exc:  # offline, no such release; a wheel cache that cannot be made
        print(f"fetch_wheels: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

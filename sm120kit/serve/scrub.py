"""`python -m sm120kit.serve.scrub NAME -- ARGV...`: run ARGV with its output scrubbed of
the API key in $NAME, for a container whose output is the log (Kubernetes: `kubectl
logs`). sglang writes its server_args, key included, into its own log; `serve` scrubs the
lines it echoes, and this does the same where no supervisor of ours stands between the
server and the log.

The output is passed on as it comes, the key written as "$NAME"; the end of a read that
could begin the key waits for the next one, so that a key split across two reads is
scrubbed too. SIGTERM, SIGINT and SIGHUP are passed on to the server (its drain), and the
exit status is the server's (128 + N for a signal, as a shell reports it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

USAGE = "usage: python -m sm120kit.serve.scrub NAME -- ARGV..."


def held_back(data: bytes, key: bytes) -> int:
    """How many of data's last bytes could be the start of the key."""
    return max((n for n in range(min(len(key) - 1, len(data)), 0, -1) if data.endswith(key[:n])), default=0)


def main(args: list[str]) -> int:
    if len(args) < 3 or args[1] != "--":
        print(USAGE, file=sys.stderr)
        return 2
    name, argv = args[0], args[2:]
    key = os.environ.get(name, "").encode()
    shown = f"${name}".encode()
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: server.send_signal(signum))
    assert server.stdout is not None  # stdout=PIPE
    out, pending = sys.stdout.buffer, b""
    while chunk := os.read(server.stdout.fileno(), 1 << 16):
        data = pending + chunk
        if key:
            data = data.replace(key, shown)
            keep = held_back(data, key)
            data, pending = data[: len(data) - keep], data[len(data) - keep :]
        out.write(data)
        out.flush()
    out.write(pending)
    out.flush()
    code = server.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

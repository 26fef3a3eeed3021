"""One HTTP health probe. sglang's /health_generate runs a one-token generation: 200 when
the scheduler answered, 503 while starting (warmup) or shutting down, 503 after
SGLANG_HEALTH_CHECK_TIMEOUT (20 s) when the scheduler is stuck. Plain http.client: no
proxy settings apply to a probe of our own loopback server. The supervisor sends each
probe from a thread of its own (ThreadProber): a server that does not answer never holds
it up."""

from __future__ import annotations

import http.client
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

HEALTH_PATH = "/health_generate"


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    status: int | None  # HTTP status, None if no answer
    detail: str  # "200", "503 (starting or shutting down)", "timed out after 30 s", ...
    seconds: float


def probe(host: str, port: int, timeout: float, api_key: str | None = None, path: str = HEALTH_PATH) -> ProbeResult:
    began = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        conn.request("GET", path, headers=headers)
        status = conn.getresponse().status
    except TimeoutError:
        return ProbeResult(False, None, f"timed out after {timeout:g} s", time.monotonic() - began)
    except ConnectionRefusedError:
        return ProbeResult(False, None, "connection refused", time.monotonic() - began)
    except (OSError, http.client.HTTPException) as exc:
        return ProbeResult(False, None, f"{type(exc).__name__}: {exc}", time.monotonic() - began)
    except Exception as exc:
        return ProbeResult(False, None, f"the probe could not be sent ({type(exc).__name__})", time.monotonic() - began)
    finally:
        conn.close()
    detail = str(status) + (" (starting or shutting down)" if status == 503 else "")
    return ProbeResult(status == 200, status, detail, time.monotonic() - began)


class Prober(Protocol):
    """Probes the supervisor sends and the answers it collects (a Protocol, so that tests
    can answer for a fake server)."""

    def start(self, attempt: int) -> None:
        """Send a probe on behalf of that start of the server."""

    def results(self) -> list[tuple[int, ProbeResult]]:
        """The answers that came since the last call: (attempt, result)."""


class ThreadProber:
    """Each probe in a thread of its own; its answer waits in a queue, and wake() ends the
    supervisor's wait for it."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        api_key: str | None,
        wake: Callable[[], None],
        path: str = HEALTH_PATH,
    ) -> None:
        self.host, self.port, self.timeout, self.api_key, self.path = host, port, timeout, api_key, path
        self._wake = wake
        self._answers: queue.SimpleQueue[tuple[int, ProbeResult]] = queue.SimpleQueue()

    def start(self, attempt: int) -> None:
        def work() -> None:
            try:
                result = probe(self.host, self.port, self.timeout, self.api_key, self.path)
            except BaseException as exc:  # a failed probe, never a dead thread; its text may hold the key
                result = ProbeResult(False, None, f"probe error ({type(exc).__name__})", 0.0)
            self._answers.put((attempt, result))
            self._wake()

        threading.Thread(target=work, name="probe", daemon=True).start()

    def results(self) -> list[tuple[int, ProbeResult]]:
        found = []
        while True:
            try:
                found.append(self._answers.get_nowait())
            except queue.Empty:
                return found

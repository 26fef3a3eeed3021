"""One HTTP health probe. sglang's /health_generate runs a one-token generation: 200 when
the scheduler answered, 503 while starting (warmup) or shutting down, 503 after
SGLANG_HEALTH_CHECK_TIMEOUT (20 s) when the scheduler is stuck. Plain http.client: no
proxy settings apply to a probe of our own loopback server."""

from __future__ import annotations

import http.client
import time
from dataclasses import dataclass

HEALTH_PATH = "/health_generate"


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    status: int | None  # HTTP status, None if no answer
    detail: str  # "200", "503 (starting or shutting down)", "timed out after 30 s", ...
    seconds: float


def probe_host(bind_host: str) -> str:
    """Where to reach a server bound to bind_host from this node."""
    host = bind_host.strip("[]")
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


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

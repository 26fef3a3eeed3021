"""The smoke's requests: sglang's native POST /generate, greedy (temperature 0) with a fixed
`sampling_seed` (SamplingParams has it in every release of the window, 0.5.9+; a server
that refuses the field, an older one, gets the requests without it), one connection per
request, http.client and threads only. A request that fails (a timeout, a 5xx, an answer
that is not JSON) is a Reply with its error: the checks count it. A server that is not
there, or refuses the key, is a UserError: nothing can be checked."""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from dataclasses import dataclass, field

from sm120kit.errors import UserError
from sm120kit.urls import parse_http_url

REACH_TIMEOUT_S = 10.0


class Unreachable(UserError):
    """No server answers at the URL (refused, timed out, not ready): nothing was checked."""


@dataclass(frozen=True)
class Reply:
    text: str = ""
    completion_tokens: int | None = None
    finish: str | None = None  # meta_info.finish_reason.type
    meta: dict = field(default_factory=dict, repr=False)
    error: str | None = None  # the request failed: "timed out after 60 s", "HTTP 500: ..."
    seconds: float = 0.0
    unanswered: bool = False  # no answer at all (a timeout, a refused or reset connection): not an HTTP error


class Client:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 60.0, seed: int | None = 0) -> None:
        parts = parse_http_url(url)  # a BadUrl (ValueError) for a malformed one: the CLI's url_option said it first
        self.url, self.host, self.port = url, parts.host, parts.port
        self.https = parts.scheme == "https"
        self.timeout = timeout
        self.seed = seed  # sampling_seed; None once the server refused the field
        self._headers = {"Content-Type": "application/json"}
        self._keyed = bool(api_key)
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout)

    def _exchange(self, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
        conn = self._connection(timeout)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None, self._headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def _refused(self, status: int) -> UserError:
        what = "refuses the API key" if self._keyed else "asks for an API key"
        return UserError(
            f"the server at {self.url} {what} ({status}){'' if self._keyed else ' and none was given'}: "
            "nothing was checked",
            "export the key the server was started with (the profile's server.api_key_env, or OPENAI_API_KEY)",
        )

    def get_json(self, path: str) -> dict | None:
        """GET path as JSON; None when the server answers it with an error or not JSON."""
        try:
            status, data = self._exchange("GET", path, None, REACH_TIMEOUT_S)
        except (OSError, http.client.HTTPException):
            return None
        if status in (401, 403):
            raise self._refused(status)
        try:
            return json.loads(data) if status == 200 else None
        except ValueError:
            return None

    def reach(self, name: str | None = None) -> str | None:
        """Before any task: the server answers /v1/models; the model it serves (its id).
        `name`: the profile, for the command a refusal names."""
        try:
            status, data = self._exchange("GET", "/v1/models", None, REACH_TIMEOUT_S)
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(
                f"no sglang server at {self.url} ({getattr(exc, 'strerror', None) or exc}): nothing was checked",
                f"start it first (sm120kit serve {name or 'PROFILE'}), or pass the right --url",
            ) from None
        if status in (401, 403):
            raise self._refused(status)
        if status != 200:
            raise Unreachable(
                f"the server at {self.url} answers /v1/models with {status}: not ready (or not sglang), "
                "nothing was checked",
                "wait until `sm120kit ps` says ready, or pass the right --url",
            )
        try:
            models = json.loads(data).get("data") or []
            return str(models[0]["id"]) if models else None
        except (ValueError, AttributeError, KeyError, TypeError, IndexError):
            return None

    def payload(self, text: str, max_new_tokens: int, **extra) -> dict:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return {"text": text, "sampling_params": params, **extra}

    def generate(self, text: str, max_new_tokens: int, deadline: float | None = None, **extra) -> Reply:
        """One non-streamed /generate, given up after the client's timeout or at `deadline`
        (time.monotonic()), whichever comes first."""
        began = time.monotonic()
        timeout = self.timeout if deadline is None else max(0.05, min(self.timeout, deadline - began))
        body = self.payload(text, max_new_tokens, **extra)
        try:
            status, data = self._exchange("POST", "/generate", body, timeout)
        except TimeoutError:
            return Reply(error=f"timed out after {timeout:g} s", seconds=time.monotonic() - began, unanswered=True)
        except (OSError, http.client.HTTPException) as exc:
            return Reply(error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - began, unanswered=True)
        if status in (401, 403):
            raise self._refused(status)
        if status != 200 and self.seed is not None and b"sampling_seed" in data:  # 400, or 500 (a TypeError)
            self.seed = None  # a release without the field: greedy is deterministic enough without it
            return self.generate(text, max_new_tokens, deadline, **extra)
        seconds = time.monotonic() - began
        try:
            doc = json.loads(data)
        except ValueError:
            doc = None
        if status != 200 or not isinstance(doc, dict):
            message = doc.get("error", {}).get("message") if isinstance(doc, dict) else None
            shown = message or data[:200].decode("utf-8", errors="replace")
            return Reply(error=f"HTTP {status}: {shown}".strip(), seconds=seconds)
        meta = doc.get("meta_info")
        if not isinstance(meta, dict):
            meta = {}
        finish = meta.get("finish_reason")
        answer = doc.get("text")
        return Reply(
            text=answer if isinstance(answer, str) else "",
            completion_tokens=meta.get("completion_tokens") if isinstance(meta.get("completion_tokens"), int) else None,
            finish=finish.get("type") if isinstance(finish, dict) else None,
            meta=meta,
            seconds=seconds,
        )

    def stream(
        self, text: str, max_new_tokens: int, deadline: float | None = None, incremental: bool | None = None
    ) -> Reply:
        """One streamed /generate (`"stream": true`), read to its `data: [DONE]`: sglang's
        events each carry the text so far, or only their own piece where the server runs
        with --incremental-streaming-output (`incremental`, as /server_info says; None:
        judged from the events, which then each extend the one before or not). The
        Reply's text is the whole answer so assembled, as a non-streamed request gets it."""
        began = time.monotonic()
        end = began + self.timeout if deadline is None else min(began + self.timeout, deadline)
        conn = self._connection(max(0.05, end - began))
        body = json.dumps(self.payload(text, max_new_tokens, stream=True))
        texts: list[str] = []
        meta: dict = {}
        try:
            conn.request("POST", "/generate", body, self._headers)
            response = conn.getresponse()
            if response.status in (401, 403):
                raise self._refused(response.status)
            if response.status != 200:
                shown = response.read()[:200].decode("utf-8", errors="replace")
                return Reply(error=f"HTTP {response.status}: {shown}".strip(), seconds=time.monotonic() - began)
            done = False
            for raw in response:
                if time.monotonic() > end:
                    return Reply(error="timed out mid-stream", seconds=time.monotonic() - began, unanswered=True)
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    return Reply(error=f"a streamed event is not JSON: {data[:80]!r}", seconds=time.monotonic() - began)
                if not isinstance(event, dict):
                    return Reply(
                        error=f"a streamed event is not an object: {data[:80]!r}", seconds=time.monotonic() - began
                    )
                if isinstance(event.get("error"), dict):
                    message = event["error"].get("message") or event["error"]
                    return Reply(error=f"error mid-stream: {message}", seconds=time.monotonic() - began)
                piece = event.get("text")
                texts.append(piece if isinstance(piece, str) else "")
                event_meta = event.get("meta_info")
                if isinstance(event_meta, dict):
                    meta = event_meta
        except TimeoutError:
            return Reply(error="timed out mid-stream", seconds=time.monotonic() - began, unanswered=True)
        except (OSError, http.client.HTTPException) as exc:
            return Reply(error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - began, unanswered=True)
        finally:
            conn.close()
        if not done:
            return Reply(error="the stream ended without data: [DONE]", seconds=time.monotonic() - began)
        finish = meta.get("finish_reason")
        return Reply(
            text=assembled(texts, incremental),
            completion_tokens=meta.get("completion_tokens") if isinstance(meta.get("completion_tokens"), int) else None,
            finish=finish.get("type") if isinstance(finish, dict) else None,
            meta={**meta, "events": len(texts)},
            seconds=time.monotonic() - began,
        )

    def burst(self, texts: list[str], max_new_tokens: int, deadline: float | None = None) -> list[Reply]:
        """Every text at once, one thread and connection each, released together; each
        request given up at `deadline` at the latest."""
        replies: list[Reply | None] = [None] * len(texts)
        gate = threading.Barrier(len(texts))

        def one(i: int) -> None:
            try:
                gate.wait(self.timeout)
            except threading.BrokenBarrierError:
                pass  # a thread that could not start in time: go anyway
            try:
                replies[i] = self.generate(texts[i], max_new_tokens, deadline)
            except UserError as exc:  # the key, refused mid-burst
                replies[i] = Reply(error=exc.message)
            except Exception as exc:  # a failed request, never a dead thread
                replies[i] = Reply(error=f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=one, args=(i,), daemon=True, name="smoke") for i in range(len(texts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [r or Reply(error="no reply") for r in replies]


def assembled(texts: list[str], incremental: bool | None) -> str:
    """A streamed answer from its events' texts: joined where each is its own piece,
    the last where each is the text so far."""
    if incremental is None:
        incremental = not all(b.startswith(a) for a, b in itertools.pairwise(texts))
    return "".join(texts) if incremental else (texts[-1] if texts else "")

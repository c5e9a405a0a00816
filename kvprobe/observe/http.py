"""Reaching an engine over HTTP: a GET with an overall deadline, a one-line reason for a failed
request, and the two ways a credential stays hidden (a URL's user:password@, an API key).

The API key of an attached target lives only in a `Secret` and in request headers built on
demand; `repr`, `str`, facts, logs and exceptions never contain it.
"""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.parse
import urllib.request

from kvprobe.errors import ConfigError


class Secret:
    """Holds an API key; renders as *** everywhere a person or a log could see it."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "_Secret('***')"

    __str__ = __repr__


def read_key(env_name: str, environ, *, key: str = "api_key_env") -> Secret:
    """The API key in `environ[env_name]`; unset or empty is bad input (exit 2), named by `key`."""
    value = environ.get(env_name)
    if not value:
        raise ConfigError(f"the environment variable {env_name!r} that should hold the engine's API key is not set "
                          f"or empty (export {env_name}=... before running kvprobe)", key=key)
    return Secret(value)


# No proxy: an engine is reached directly, and an http_proxy from the environment must neither
# intercept 127.0.0.1 nor ever see the API key.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, *, headers: dict[str, str] | None = None, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET with an overall deadline: a server that drips bytes cannot hold us past ~2x `timeout`.

    Returns (status, body) for any HTTP status; raises OSError/URLError when there is no answer.
    """
    deadline = time.monotonic() + timeout
    req = urllib.request.Request(url, headers=dict(headers or {}), method="GET")
    try:
        resp = _OPENER.open(req, timeout=timeout)
    except urllib.error.HTTPError as err:
        with contextlib.closing(err):
            return err.code, err.read() if err.fp is not None else b""
    with contextlib.closing(resp):
        chunks = []
        while True:
            if time.monotonic() > deadline:  # each recv is bounded by `timeout`, the total by 2x
                raise TimeoutError(f"GET {url}: body not complete within {timeout:g} s")
            chunk = resp.read1(65536)
            if not chunk:
                return resp.status, b"".join(chunks)
            chunks.append(chunk)


def error_reason(err: BaseException) -> str:
    """One line for a failed request, without headers (they may carry the API key)."""
    if isinstance(err, urllib.error.URLError) and not isinstance(err, urllib.error.HTTPError):
        return f"{type(err.reason).__name__}: {err.reason}"
    return f"{type(err).__name__}: {err}"


def redact_url(url: str) -> str:
    """The URL without user:password@ (a URL is a place people paste credentials into)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))

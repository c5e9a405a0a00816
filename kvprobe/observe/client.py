"""The probe's own single requests through the `openai` client: its base URL, its auth and its
typed errors (a 401/403 is `AuthenticationError` / `PermissionDeniedError`, said as the API key).
The Locust load path keeps its own lean client (kvprobe.load).

The client is built per call: no retries (a calibration shot retried silently would be timed
twice), no proxy from the environment (an http_proxy must neither intercept 127.0.0.1 nor see the
key), and the key given explicitly, so an OPENAI_API_KEY of the user's never reaches an engine.
"""

from __future__ import annotations

from kvprobe.errors import ConfigError

# Sent when no key is given: the client needs one, and an engine started without --api-key ignores it.
_NO_KEY = "EMPTY"
# Where a person names the API key's variable, on either face.
KEY_OPTIONS = "--api-key-env (or target.api_key_env)"


def split_headers(headers: dict[str, str] | None) -> tuple[str | None, dict[str, str]]:
    """(the bearer key, the other headers) of a target's request headers."""
    key, rest = None, {}
    for name, value in (headers or {}).items():
        if name.lower() == "authorization" and value.startswith("Bearer "):
            key = value[len("Bearer "):]
        else:
            rest[name] = value
    return key, rest


def engine_client(url: str, *, prefix: str = "/v1", headers: dict[str, str] | None = None, timeout: float = 60.0):
    """An `openai.OpenAI` client of the engine at `url` (its OpenAI routes under `prefix`)."""
    import openai

    key, rest = split_headers(headers)
    return openai.OpenAI(base_url=url.rstrip("/") + prefix, api_key=key or _NO_KEY, default_headers=rest,
                         max_retries=0, timeout=timeout, http_client=openai.DefaultHttpxClient(trust_env=False))


def key_refused(url: str, status: int, what: str, *, key_sent: bool, api_key_env: str | None = None,
                key: str = KEY_OPTIONS, file: str | None = None) -> ConfigError:
    """The bad input a 401/403 means: the API key, and where to name its variable."""
    from kvprobe.observe.http import redact_url

    where = f"the engine at {redact_url(url)} answered HTTP {status} to {what}"
    if not key_sent:
        return ConfigError(f"{where}: it was started with an API key (--api-key) and kvprobe sent none; put the key "
                           f"in an environment variable and name that variable in {key}", file=file, key=key)
    held = f"in ${api_key_env}" if api_key_env else "kvprobe sent"
    return ConfigError(f"{where}: it refused the API key {held}; {key} must name the variable holding the key the "
                       "engine was started with (--api-key)", file=file, key=key)


def is_auth_error(err: BaseException) -> bool:
    import openai

    return isinstance(err, openai.AuthenticationError | openai.PermissionDeniedError)


def list_models(url: str, *, prefix: str = "/v1", headers: dict[str, str] | None = None,
                timeout: float = 5.0) -> tuple[int, dict | None]:
    """GET {prefix}/models through the client: (HTTP status, the JSON body as the engine sent it, extra
    fields such as vLLM's max_model_len included; None unless a JSON object). Raises ConnectionError
    (an OSError, as every other read of an engine does) when nothing answers."""
    import openai

    client = engine_client(url, prefix=prefix, headers=headers, timeout=timeout)
    try:
        raw = client.models.with_raw_response.list()
    except openai.APIStatusError as err:
        return err.status_code, None
    except openai.APIConnectionError as err:
        cause = err.__cause__
        raise ConnectionError(f"GET {prefix}/models: {err}" + (f" ({cause})" if cause else "")) from None
    finally:
        client.close()
    try:
        body = raw.http_response.json()
    except ValueError:
        return raw.http_response.status_code, None
    return raw.http_response.status_code, body if isinstance(body, dict) else None


def check_access(url: str, *, path: str, api_key, api_key_env: str | None, key: str, file: str | None = None) -> bool:
    """One GET of a guarded path (`/v1/models`, which both engines guard with `--api-key`) through
    the client: a 401 or 403 is bad input naming the API key and `key` (`--api-key-env`,
    `target.api_key_env`), said before anything else reads the engine. Any other status: True (the
    server answered); no answer: False, and the caller's own reads say why. `api_key`: a Secret."""
    if not path.endswith("/models"):
        raise ValueError(f"expected a models path ending in /models, got {path!r}")
    headers = {"Authorization": f"Bearer {api_key.reveal()}"} if api_key is not None else {}
    try:
        status, _ = list_models(url, prefix=path[:-len("/models")], headers=headers, timeout=5.0)
    except OSError:
        return False
    if status not in (401, 403):
        return True
    raise key_refused(url, status, f"GET {path}", key_sent=api_key is not None, api_key_env=api_key_env, key=key,
                      file=file)

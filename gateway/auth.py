"""API keys: which tenant sent a request, from its ``Authorization: Bearer <key>`` header.

A :class:`KeyRing` holds the SHA-256 of every key (never a key) with its :class:`Tenant`: the
config's ``auth.api_keys`` and, when the environment variable :data:`KEYS_FILE_ENV` names one, a
YAML file holding a list of such entries (re-read by :meth:`KeyRing.reload`, on SIGHUP and on
``POST /admin/keys/reload``). :meth:`KeyRing.resolve` hashes the presented key and compares it
with every configured hash by ``hmac.compare_digest``, with no early exit, so the time taken does
not say which entry matched, nor whether one did.

:class:`ApiKeys` is the ASGI wrapper that asks for a key on the routes that need one
(:func:`needs_key`) and leaves the tenant in the scope under :data:`gateway.tenants.SCOPE_KEY`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import structlog
import yaml
from litestar.utils import normalize_path
from pydantic import TypeAdapter, ValidationError

from gateway.config import ApiKeyConfig, AuthConfig, GatewayConfig
from gateway.errors import APIError, ConfigError
from gateway.http_edge import send_error
from gateway.tenants import SCOPE_KEY, Tenant

# Names a YAML file holding a list of ``api_keys`` entries, read besides the config's.
KEYS_FILE_ENV = "SLUICE_API_KEYS_FILE"
# What ``sluice keys add`` puts before a new key's random part (as OpenAI's ``sk-``).
KEY_PREFIX = "sk-sluice-"
# Random bytes of a new key (``secrets.token_urlsafe``): 256 bits.
KEY_RANDOM_BYTES = 32
# The tokenizer routes (vLLM's), outside ``/v1`` but serving a model as ``/v1`` does.
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})
# ``/v1`` routes behind the admin token instead (vLLM's adapter routes): they read the same header.
ADMIN_V1_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# Open unless ``auth.protect_metrics``.
METRICS_PATHS = frozenset({"/metrics", "/stats"})

log = structlog.get_logger(__name__)
_ENTRIES = TypeAdapter(list[ApiKeyConfig])

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


def key_sha256(key: str) -> str:
    """The ``key_sha256`` of a key: SHA-256 of its UTF-8 text, lower-case hex (64 characters)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A new random API key: :data:`KEY_PREFIX` and 256 random bits, URL-safe base64 (53 characters)."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)


def invalid_api_key(reason: str) -> APIError:
    """401 ``invalid_api_key`` in OpenAI's body, with ``WWW-Authenticate: Bearer``; ``reason``
    never holds the key."""
    return APIError(
        401, f"Incorrect API key provided: {reason}. Send 'Authorization: Bearer <key>' with a key of this gateway.",
        "invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
    )


def read_keys_file(path: Path) -> list[ApiKeyConfig]:
    """The ``api_keys`` entries of a keys file: a YAML list of entries (empty file: none).

    Raises:
        ConfigError: unreadable file, bad YAML, not a list, or an invalid entry; the message
            names the file and the entry's field path (``keys.yaml: 2.key_sha256: ...``),
            never the value (a key pasted where its hash belongs stays out of the logs).
    """
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the API keys file: {exc.strerror}", code="invalid_keys_file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}", code="invalid_keys_file") from None
    try:
        return _ENTRIES.validate_python([] if data is None else data)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()]
        param = ".".join(str(p) for p in exc.errors()[0]["loc"])
        raise ConfigError(
            f"{path}: invalid API keys (a list of api_keys entries)\n  " + "\n  ".join(problems),
            param=param or None, code="invalid_keys_file",
        ) from None


def check_entries(entries: Iterable[tuple[str, ApiKeyConfig]], min_priority: int, max_priority: int) -> None:
    """Check keys from several sources together (``(where, entry)``; ``where`` names the source
    and the entry's place, as ``keys.yaml: 3``).

    Raises:
        ConfigError: two entries with one name or one hash (both places named), or a
            ``priority``/``max_priority`` outside ``[min_priority, max_priority]``.
    """
    names: dict[str, str] = {}
    hashes: dict[str, str] = {}
    for where, entry in entries:
        for field_name in ("priority", "max_priority"):
            value = getattr(entry, field_name)
            if value is not None and not min_priority <= value <= max_priority:
                raise ConfigError(f"{where}.{field_name}: {value} lies outside [min_priority, max_priority] = "
                                  f"[{min_priority}, {max_priority}]", code="invalid_keys_file")
        unique = ((names, entry.name, f"the tenant name {entry.name!r}"), (hashes, entry.key_sha256, "a key_sha256"))
        for seen, value, what in unique:
            if value in seen:
                raise ConfigError(f"{where}: {what} is also at {seen[value]}; each must be unique", code="invalid_keys_file")
            seen[value] = where


class KeyRing:
    """The keys this gateway accepts, each with its tenant; swapped whole by :meth:`reload`.

    Args:
        auth: the config's ``auth`` section (``AuthConfig()`` when only a keys file is set).
        min_priority, max_priority: the config's priority range; a key's ``priority`` and
            ``max_priority`` must lie in it.
        keys_file: the file of :data:`KEYS_FILE_ENV`, or ``None``.
    Raises:
        ConfigError: the keys file is bad, or its entries clash with the config's.
    """

    def __init__(self, auth: AuthConfig, min_priority: int, max_priority: int, keys_file: Path | None = None):
        self.auth = auth
        self.keys_file = keys_file
        self._priority_range = (min_priority, max_priority)
        self._entries: tuple[tuple[bytes, Tenant], ...] = ()
        self._names: frozenset[str] = frozenset()
        self._load()

    @classmethod
    def from_config(cls, config: GatewayConfig, environ: dict[str, str] | None = None) -> KeyRing | None:
        """The key ring of ``config`` and the environment's :data:`KEYS_FILE_ENV`; ``None``
        (no auth: ``/v1`` open) when the config has no ``auth`` and no keys file is named.

        Raises:
            ConfigError: as the constructor.
        """
        keys_file = (os.environ if environ is None else environ).get(KEYS_FILE_ENV) or None
        if config.auth is None and keys_file is None:
            return None
        auth = config.auth or AuthConfig()
        return cls(auth, config.min_priority, config.max_priority, None if keys_file is None else Path(keys_file))

    def _load(self) -> None:
        """Read the keys file (if any) and swap in the new entries in one assignment."""
        entries = [(f"auth.api_keys.{k}", key) for k, key in enumerate(self.auth.api_keys)]
        if self.keys_file is not None:
            entries += [(f"{self.keys_file}: {k}", key) for k, key in enumerate(read_keys_file(self.keys_file))]
        check_entries(entries, *self._priority_range)
        tenants = tuple(
            (key.key_sha256.encode("ascii"), Tenant.from_config(key, self.auth.num_gateways)) for _, key in entries
        )
        self._entries, self._names = tenants, frozenset(t.name for _, t in tenants)

    def reload(self) -> list[str]:
        """Re-read the keys file; return the tenant names now known, sorted. Requests already
        admitted keep the tenant they resolved to.

        Raises:
            ConfigError: the file is bad (``invalid_keys_file``; the old keys stay), or no keys
                file is set (``no_keys_file``).
        """
        if self.keys_file is None:
            raise ConfigError(f"no API keys file to reload: set {KEYS_FILE_ENV} when starting the gateway",
                              code="no_keys_file")
        try:
            self._load()
        except ConfigError as exc:
            log.error("api_keys_reload_failed", error=str(exc), num_keys=len(self._entries))
            raise
        log.info("api_keys_reloaded", num_keys=len(self._entries))
        return sorted(self._names)

    def reload_quietly(self) -> None:
        """:meth:`reload` for a signal handler: a bad file (or none to reload) is logged, not raised."""
        try:
            self.reload()
        except ConfigError as exc:
            if exc.code == "no_keys_file":  # a bad file is logged by reload
                log.error("api_keys_reload_failed", error=str(exc), num_keys=len(self._entries))

    def tenant_names(self) -> frozenset[str]:
        """The configured tenants' names (the ``tenant`` metric label's values, with ``anonymous``)."""
        return self._names

    def resolve(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header's ``Bearer <key>``.

        The key's SHA-256 is compared with every configured hash (``hmac.compare_digest``, one
        call per key, no early exit).

        Raises:
            APIError: 401 ``invalid_api_key`` for a missing header, another scheme, an empty
                key or an unknown key.
        """
        if authorization is None:
            raise invalid_api_key("no key was sent")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise invalid_api_key("the Authorization header is not 'Bearer <key>'")
        digest = key_sha256(key).encode("ascii")
        found: Tenant | None = None
        for expected, tenant in self._entries:
            if hmac.compare_digest(digest, expected):
                found = tenant
        if found is None:
            raise invalid_api_key("the key is not one of this gateway's")
        return found


def warn_if_open(config: GatewayConfig, host: str, environ: dict[str, str] | None = None) -> bool:
    """Log one ``api_open_to_network`` warning when ``sluice serve`` listens on a non-loopback
    ``host`` with no API keys (no ``auth``, no :data:`KEYS_FILE_ENV`); return whether it did."""
    if config.auth is not None or (os.environ if environ is None else environ).get(KEYS_FILE_ENV):
        return False
    try:
        is_loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        is_loopback = False
    if not is_loopback:
        log.warning("api_open_to_network", host=host, message=(
            f"/v1 is open to anyone who can reach {host}: the config has no auth section; "
            "add API keys (sluice keys add NAME) to require them"))
    return not is_loopback


def needs_key(path: str, protect_metrics: bool) -> bool:
    """Whether a request to ``path`` needs an API key: ``/v1/*`` (but the adapter routes behind
    the admin token), the tokenizer routes, and with ``protect_metrics`` ``/metrics``, ``/stats``
    and ``/dashboard*``. ``/health`` and ``/admin/*`` (its own token) never do. ``path`` is
    normalised as litestar's router does before it routes (repeated and trailing slashes
    dropped), so ``//v1/models`` or ``/tokenize/`` needs the key that the route it reaches needs."""
    path = normalize_path(path)
    if path.startswith("/v1/") or path == "/v1":
        return path not in ADMIN_V1_PATHS
    if path in TOKENIZER_PATHS:
        return True
    return protect_metrics and (path in METRICS_PATHS or path.startswith("/dashboard"))


def _authorization(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The first ``Authorization`` header, as UTF-8 (:func:`key_sha256` hashes a key's UTF-8
    text); bytes that are not UTF-8 become U+FFFD, so they match no key."""
    value = next((v for k, v in headers if k.lower() == b"authorization"), None)
    return None if value is None else value.decode("utf-8", "replace")


class ApiKeys:
    """An ASGI wrapper resolving the caller's tenant (:meth:`KeyRing.resolve`) on the paths
    that need a key (:func:`needs_key`) and answering a 401 there without one. Other paths
    pass through as :data:`gateway.tenants.ANONYMOUS`."""

    def __init__(self, app: ASGIApp, keys: KeyRing):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not needs_key(scope["path"], self.keys.auth.protect_metrics):
            await self.app(scope, receive, send)
            return
        try:
            tenant = self.keys.resolve(_authorization(scope.get("headers", [])))
        except APIError as error:
            await send_error(send, error)
            return
        scope[SCOPE_KEY] = tenant
        await self.app(scope, receive, send)

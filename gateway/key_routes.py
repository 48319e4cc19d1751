"""Reloading the API keys file at run time: ``POST /admin/keys/reload`` (behind the admin token,
:func:`gateway.admin.admin_guard`) and SIGHUP, both through :meth:`gateway.auth.KeyRing.reload`."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from typing import Any

import structlog
from litestar import Controller, Request, post

from gateway.admin import admin_guard
from gateway.auth import KeyRing
from gateway.errors import APIError, ConfigError

log = structlog.get_logger(__name__)
audit_log = structlog.get_logger("sluice.admin")


class KeysController(Controller):
    path = "/admin/keys"
    guards = [admin_guard]

    @post("/reload", status_code=200)
    async def reload(self, request: Request[Any, Any, Any]) -> dict[str, Any]:
        """Re-read ``SLUICE_API_KEYS_FILE``; answer ``{"tenants": [names], "num_keys": n}``.

        Raises:
            APIError: 409 ``auth_disabled`` without ``auth`` (nor a keys file), 409
                ``no_keys_file`` without a keys file; 400 ``invalid_keys_file`` naming the file
                and the entry's field for a bad file (the old keys stay).
        """
        keys: KeyRing | None = request.app.state.api_keys
        if keys is None:
            raise APIError(409, "API keys are off: the config has no auth section and SLUICE_API_KEYS_FILE is not set",
                           "invalid_request_error", code="auth_disabled")
        try:
            tenants = await asyncio.to_thread(keys.reload)
        except ConfigError as exc:
            status = 409 if exc.code == "no_keys_file" else 400
            raise APIError(status, str(exc), "invalid_request_error", exc.param, exc.code) from None
        client = request.client.host if request.client else None
        audit_log.info("admin_audit", who=client, action="reload_keys", num_keys=len(tenants))
        return {"tenants": tenants, "num_keys": len(tenants)}


@contextlib.contextmanager
def reloading_on_sighup(keys: KeyRing | None) -> Iterator[None]:
    """While inside, SIGHUP reloads ``keys``' file (:meth:`KeyRing.reload_quietly`, on the event
    loop; with keys but no keys file it logs that there is none to reload, rather than ending
    the gateway as SIGHUP's default action would); the handler is removed on exit. Nothing is
    installed without keys, nor where the loop cannot take signal handlers (not the main
    thread, or not Unix)."""
    if keys is None:
        yield
        return
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, keys.reload_quietly)
    except (ValueError, RuntimeError, NotImplementedError, AttributeError) as exc:
        log.warning("sighup_reload_unavailable", error=str(exc))
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGHUP)

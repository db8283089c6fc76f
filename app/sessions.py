"""Viewer sessions: a signed cookie naming a session that the database keeps until sign-out.

The cookie holds a random session id, the service's name and an expiry,
signed under a key derived from the accepted tokens (rotating them signs
everyone out). The server keeps one document per open session, under the
session id's digest: signing out deletes it, so a copy of the cookie opens
nothing afterwards, on every process serving the same database.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from datetime import UTC, datetime
from typing import Any

from pymongo import ASCENDING, IndexModel

from agent_store.store import Database, storage_errors
from app.auth import Authenticator

SESSION_COOKIE = "agent_store_viewer"
SESSION_SECONDS = 8 * 3600
VIEWER_SESSIONS = "viewer_sessions"
"""Open viewer sessions: `_id` (the session id's SHA-256), `service`, `expires_at`."""
SESSION_INDEXES = [IndexModel([("expires_at", ASCENDING)], expireAfterSeconds=0)]
"""The database drops expired sessions by itself; reads check the expiry regardless."""


def _session_key(authenticator: Authenticator) -> bytes:
    return hmac.new(
        b"agent-store viewer session", b"".join(sorted(authenticator.secrets)), hashlib.sha256
    ).digest()


def issue_session(
    authenticator: Authenticator, service: str, now: float, *, session_id: str | None = None
) -> str:
    """A signed cookie value for a new session of `service`, valid `SESSION_SECONDS`."""
    claims = {
        "sid": session_id or secrets.token_urlsafe(32),
        "service": service,
        "expires": int(now) + SESSION_SECONDS,
    }
    payload = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode()
    signature = hmac.new(_session_key(authenticator), payload.encode(), hashlib.sha256).hexdigest()
    return f"{payload}.{signature}"


def session_claims(authenticator: Authenticator, cookie: str | None, now: float) -> dict[str, Any]:
    """The claims of a cookie whose signature holds and which has not expired; else `{}`."""
    if not cookie or "." not in cookie:
        return {}
    payload, _, signature = cookie.rpartition(".")
    expected = hmac.new(_session_key(authenticator), payload.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        return {}
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload.encode()))
        sid, service, expires = str(claims["sid"]), str(claims["service"]), int(claims["expires"])
    except (ValueError, KeyError, TypeError):
        return {}
    return {"sid": sid, "service": service, "expires": expires} if now < expires else {}


def session_service(authenticator: Authenticator, cookie: str | None, now: float) -> str | None:
    """The service a validly signed, unexpired cookie names (the server's record aside)."""
    service = session_claims(authenticator, cookie, now).get("service")
    return str(service) if service is not None else None


def _record_id(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class ViewerSessions:
    """Opens, checks and revokes viewer sessions kept in `viewer_sessions`."""

    def __init__(self, db: Database, authenticator: Authenticator) -> None:
        self._sessions = db[VIEWER_SESSIONS]
        self._authenticator = authenticator

    async def ensure_indexes(self) -> None:
        with storage_errors("create the viewer session index"):
            await self._sessions.create_indexes(SESSION_INDEXES)

    async def open(self, service: str, now: float) -> str:
        """Record a new session and return its cookie value."""
        session_id = secrets.token_urlsafe(32)
        cookie = issue_session(self._authenticator, service, now, session_id=session_id)
        expires_at = datetime.fromtimestamp(int(now) + SESSION_SECONDS, UTC)
        with storage_errors("open a viewer session"):
            await self._sessions.insert_one(
                {"_id": _record_id(session_id), "service": service, "expires_at": expires_at}
            )
        return cookie

    async def service_of(self, cookie: str | None, now: float) -> str | None:
        """The service of an open session: signed, unexpired and not signed out."""
        claims = session_claims(self._authenticator, cookie, now)
        if not claims:
            return None
        with storage_errors("read the viewer session"):
            record = await self._sessions.find_one({"_id": _record_id(claims["sid"])})
        if record is None or record.get("service") != claims["service"]:
            return None
        return str(claims["service"])

    async def close(self, cookie: str | None, now: float) -> None:
        """Revoke the session the cookie names, if it is one of ours."""
        claims = session_claims(self._authenticator, cookie, now)
        if claims:
            with storage_errors("close the viewer session"):
                await self._sessions.delete_one({"_id": _record_id(claims["sid"])})

"""Who is calling: a service bearer token, optionally a user token, noted for the audit line.

Every route but the probes (`/health`, `/ready`) and the public documents
(`/openapi.json`, `/docs`, `/metrics` as configured) needs a service token. A
request that also carries `X-User-JWT` acts for that user only: its `sub` is
the only `user_id` it sees.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass
from typing import Any

import jwt
from starlette.datastructures import Headers
from starlette.types import Scope

from agent_store.core import InvalidInput
from agent_store.store import refuse_derived_user, validate_identifier
from app.http_errors import Forbidden, Unauthorized
from app.settings import Settings

USER_TOKEN_HEADER = "x-user-jwt"
AUDIT_SCOPE_KEY = "agent_store.audit"
_JWT_LEEWAY_SECONDS = 30


def token_actor(token: str) -> str:
    """How an unnamed token appears in logs: a digest prefix, never the token."""
    return "token-sha256:" + hashlib.sha256(token.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Caller:
    """The authenticated caller of one request."""

    service: str
    """The service token's name (or digest prefix)."""
    user_id: str | None = None
    """The user a user token speaks for; None when the service acts on its own."""

    def require_user(self, user_id: str) -> None:
        """Refuse acting on `user_id`'s data with another user's token."""
        if self.user_id is not None and self.user_id != user_id:
            raise Forbidden(f"a user token for {self.user_id!r} may not act on another user's data")


class Authenticator:
    """Checks service tokens in constant time and verifies user tokens with pinned algorithms."""

    def __init__(self, settings: Settings) -> None:
        named = dict(settings.named_service_tokens)
        for token in settings.service_tokens:
            named.setdefault(token_actor(token), token)
        # Digests have one length, so comparing them leaks nothing about a token's length.
        self._tokens = [(name, hashlib.sha256(t.encode()).digest()) for name, t in named.items()]
        self._algorithms = list(settings.jwt_algorithms)
        self._audience = settings.jwt_audience
        self._issuer = settings.jwt_issuer
        self._max_lifetime = settings.max_user_token_seconds
        self._key: str | None
        if self._algorithms[0].startswith("HS"):
            self._key = settings.jwt_secret.get_secret_value() if settings.jwt_secret else None
        else:
            self._key = settings.jwt_public_key

    @property
    def secrets(self) -> list[bytes]:
        """Digests of the accepted tokens (the viewer derives its session key from them)."""
        return [digest for _, digest in self._tokens]

    def service_actor(self, token: str) -> str | None:
        """The name of the service whose token this is, or None. Compares with every token."""
        presented = hashlib.sha256(token.encode()).digest()
        actor = None
        for name, digest in self._tokens:
            if hmac.compare_digest(presented, digest) and actor is None:
                actor = name
        return actor

    def authenticate(self, headers: Headers, record: AuditRecord) -> Caller:
        """The caller of a request, noted in `record` as far as it got verified."""
        scheme, _, token = (_only_one(headers, "authorization") or "").partition(" ")
        actor = self.service_actor(token.strip()) if scheme.lower() == "bearer" else None
        if actor is None:
            raise Unauthorized("a valid service bearer token is required")
        record.service = actor
        user_token = _only_one(headers, USER_TOKEN_HEADER)
        if user_token is None:
            return Caller(service=actor)
        record.user = "(invalid token)"
        user_id = self.verify_user_token(user_token)
        record.user = user_id
        return Caller(service=actor, user_id=user_id)

    def verify_user_token(self, token: str) -> str:
        """The `sub` of a valid user token; Unauthorized naming the problem otherwise."""
        if self._key is None or self._issuer is None:
            raise Unauthorized(
                "user tokens are not accepted: the service has no JWT key or issuer configured"
            )
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                self._key,
                algorithms=self._algorithms,
                audience=self._audience,
                issuer=self._issuer,
                leeway=_JWT_LEEWAY_SECONDS,
                options={"require": ["exp", "iat", "aud", "iss", "sub"]},
            )
        except jwt.PyJWTError as exc:
            raise Unauthorized(f"invalid user token: {exc}") from exc
        times = (claims["exp"], claims["iat"])
        if not all(isinstance(t, int | float) and not isinstance(t, bool) for t in times):
            # PyJWT accepts any text int() reads; RFC 7519 times are JSON numbers.
            raise Unauthorized("invalid user token: `exp` and `iat` must be numbers")
        lifetime = times[0] - times[1]
        if lifetime > self._max_lifetime:
            # Rounded up: a lifetime a fraction of a second over the maximum is shown over it.
            shown = math.ceil(lifetime)
            rounded = "" if shown == lifetime else ", rounded up"
            raise Unauthorized(
                f"invalid user token: its lifetime (exp - iat) is {shown} s{rounded}; "
                f"at most {self._max_lifetime} s are accepted"
            )
        try:
            subject = validate_identifier(claims["sub"], "user token sub")
            return refuse_derived_user(subject, "user token sub")
        except InvalidInput as exc:
            raise Unauthorized(exc.message) from exc


@dataclass
class AuditRecord:
    """Filled in while a request is handled; written as one line when it ends."""

    service: str | None = None
    user: str | None = None


def audit_record(scope: Scope) -> AuditRecord:
    record = scope.setdefault(AUDIT_SCOPE_KEY, AuditRecord())
    assert isinstance(record, AuditRecord)
    return record


def _only_one(headers: Headers, name: str) -> str | None:
    """The one value of a credential header, None when absent. Sent twice, the request is
    refused rather than one value picked: which one a proxy in between would pick is not
    known, and a log would not show which was used."""
    values = headers.getlist(name)
    if len(values) > 1:
        raise Unauthorized(f"the {name} header is sent {len(values)} times: send it once")
    return values[0] if values else None

"""OpenAI error bodies and the middlewares that produce them (errors, API keys)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from common.log import get_logger
from gateway.broker.redis_errors import redis_error
from gateway.state import CONFIG

log = get_logger("gateway")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PROTECTED = ("/v1/", "/tokenize", "/detokenize")  # paths that need the API key when keys are set

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


class OpenAIError(Exception):
    """An error the client should see as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        return web.json_response(self.body(), status=self.status, headers=headers | (self.headers or {}))


def redis_unavailable(exc: BaseException) -> OpenAIError:
    """503 for a Redis failure: "Redis is out of memory" for OOM, else "cannot reach Redis"."""
    message, code = redis_error(exc)
    return OpenAIError(503, message, code=code)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn OpenAIError, aiohttp HTTP errors and crashes into OpenAI error bodies."""
    try:
        return await handler(request)
    except OpenAIError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[CONFIG].max_body_bytes
        return OpenAIError(413, f"request body too large (limit {limit} bytes)", code="request_too_large").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return OpenAIError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_")).response()
    except Exception:
        log.exception("unhandled error", path=request.path)
        return OpenAIError(500, "internal server error", code="internal_error").response()


def auth_middleware(api_keys: tuple[str, ...]) -> Middleware:
    """Require ``Authorization: Bearer <key>`` on PROTECTED paths when keys are configured."""
    keys = [k.encode() for k in api_keys]

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if keys and request.path.startswith(PROTECTED):
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                                  code="missing_api_key")
            given = token.strip().encode()
            if not any(hmac.compare_digest(given, key) for key in keys):
                raise OpenAIError(401, "incorrect API key provided", code="invalid_api_key")
        return await handler(request)

    return middleware

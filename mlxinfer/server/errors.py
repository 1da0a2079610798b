"""Every failure a client can see is OpenAI's error object with its status, never FastAPI's own
`{"detail": ...}` nor a traceback: what the routes raise (ApiError), what FastAPI's validation finds,
what Starlette answers itself (an unknown route, a wrong method), and anything unexpected (a 500).
The engine's messages name the model file by its path (for the CLI's user); a client reads the
model's id there instead (`public`): the server's file system is not its business."""

import os

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .schemas import REFUSED, error_object


class ApiError(Exception):
    """A request the routes refuse: its status, OpenAI's error fields and any headers (Retry-After)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                 headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                   headers=None) -> JSONResponse:
    return JSONResponse(error_object(message, type_, param, code), status_code=status, headers=headers)


def public(state, message: str) -> str:
    """`message` with the model file's path, and then its folder, replaced by the served model's id."""
    path = str(state.engine.path)
    return message.replace(path, state.model_id).replace(os.path.dirname(path) + os.sep, "")


async def api_error(request, e: ApiError):
    return error_response(e.status, public(request.app.state.server, e.message), e.type, e.param, e.code, e.headers)


async def validation_error(request, e: RequestValidationError):
    errors = e.errors()
    # a value that fits no branch of a union (a prompt is text or token ids) gets an error per branch:
    # the deepest says most ("prompt.0: ... a valid integer" for [1.9], not "prompt: ... a valid string")
    first = max(errors, key=lambda x: len(x.get("loc", ())), default={})
    where = ".".join(path(first))
    if first.get("type") == "json_invalid":
        return error_response(400, "request body is not valid JSON")
    unknown = [x for x in errors if x.get("type") == "extra_forbidden"]
    if unknown:  # a field no request model has: refused by name, never ignored (schemas.REFUSED)
        loc = path(unknown[0])
        name = loc[-1] if loc else "?"
        why = REFUSED.get(name, "this server does not support it")
        return error_response(400, f"unsupported field {'.'.join(loc)!r}: {why}", param=".".join(loc) or None,
                              code="unsupported_field")
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")  # a validator's own message
    return error_response(400, f"{where or 'body'}: {msg}", param=where or None)


BRANCHES = {"str", "int", "float", "bool"}  # pydantic's names of union branches in a loc (and list[...])


def path(error: dict) -> list[str]:
    """Where a validation error is, as the client wrote it: no "body", no union branch names."""
    return [str(x) for x in error.get("loc", ()) if x != "body" and x not in BRANCHES
            and not (isinstance(x, str) and "[" in x)]


async def http_error(request, e: HTTPException):
    return error_response(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else
                          "invalid_request_error")


async def internal_error(request, e: Exception):
    return error_response(500, public(request.app.state.server, f"internal error: {type(e).__name__}: {e}"),
                          "server_error")


HANDLERS = {ApiError: api_error, RequestValidationError: validation_error, HTTPException: http_error,
            Exception: internal_error}

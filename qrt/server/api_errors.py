"""The errors the HTTP side answers with, in OpenAI's error shape: `ApiError` for what qrt itself
refuses, and the handlers that turn FastAPI's and Starlette's own errors into the same shape."""

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import error_body


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, kind, param, code), headers


def add_error_handlers(app: FastAPI, metrics) -> None:
    """Every refusal answered in OpenAI's shape; those of a request (not of a route) counted as
    rejected in `metrics`."""

    @app.exception_handler(ApiError)
    async def _api_error(request, err: ApiError):
        if err.status in (400, 404, 413, 503):
            metrics.requests.labels(outcome="rejected").inc()
        return JSONResponse(err.body, status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, err: RequestValidationError):
        metrics.requests.labels(outcome="rejected").inc()
        first = err.errors()[0]
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            message = f"unknown field {'.'.join(where)!r}: qrt does not take it (the OpenAI API does not define it here)"
        elif first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', message)}"
            where = []  # its loc is a character offset, not a field
        elif where and not message.startswith(where[-1]):
            message = f"{'.'.join(where)}: {message}"
        return JSONResponse(error_body(message, param=".".join(where) or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(_body_problem(err.__cause__) or str(err.detail), kind),
                            status_code=err.status_code)


def _body_problem(cause: BaseException | None) -> str | None:
    """What FastAPI's 400 "There was an error parsing the body" was, where qrt can say: FastAPI
    raises it from the error of json.loads on the body's bytes."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the body is not UTF-8 text: byte 0x{cause.object[cause.start]:02x} at offset {cause.start} "
                f"({cause.reason})")
    if isinstance(cause, RecursionError):
        return "the body's JSON is nested too deeply to parse"
    return None

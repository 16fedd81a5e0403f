"""OpenAI error envelope: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(
            self.status, self.message, param=self.param, type_=self.type, code=self.code, headers=self.headers
        )


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    type_: str = "invalid_request_error",
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}},
        status_code=status,
        headers=headers,
    )


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)

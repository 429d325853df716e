"""OpenAI-style HTTP errors: what the ingress answers, as JSON or as an SSE error event."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from deploy.protocol import ERROR_TYPES, EngineError, ErrorBody, ErrorResponse

NOT_READY_RETRY_S = 5  # Retry-After of a 503 while engines load, restart or the server drains


class ApiError(Exception):
    """An error answered to the client as OpenAI error JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    @classmethod
    def from_engine(cls, err: EngineError) -> "ApiError":
        return cls(err.status, err.message, param=err.param, code=err.code, retry_after=err.retry_after)

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=ERROR_TYPES.get(self.status, "error"),
                                             param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body().model_dump(mode="json"), status_code=self.status, headers=headers)

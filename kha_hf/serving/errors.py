"""The error a request gets from kha serve's own checks, in OpenAI's error format."""

from __future__ import annotations

import json


class RequestError(Exception):
    """A request the guard (or a handler) answers itself, in OpenAI's error format. KIND is the error's type:
    "invalid_request_error" (the request's fault) or "server_error"."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self):
        """This error as a starlette Response (starlette comes with the serving extras: imported here, not above)."""
        from starlette.responses import Response

        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return Response(json.dumps({"error": error}), status_code=self.status, media_type="application/json")

"""Exception types that users see. The server maps them to HTTP status codes."""


class KestrelError(Exception):
    status_code = 500
    error_type = "internal_error"


class InvalidRequest(KestrelError, ValueError):
    """A request the engine refuses (HTTP 400). `param` names the offending field."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class NotFound(InvalidRequest):
    status_code = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    pass


class EngineDead(KestrelError, RuntimeError):
    """The engine-core process is gone (HTTP 503); every waiting request fails with this."""

    status_code = 503
    error_type = "engine_dead"


class EngineSleeping(KestrelError, RuntimeError):
    """The server was put to sleep (/sleep): requests get HTTP 503 until /wake_up, instead of waiting."""

    status_code = 503
    error_type = "engine_sleeping"


class ConfigError(KestrelError, ValueError):
    """A start-up configuration that cannot work (bad flag combination, a forced kernel that cannot serve)."""

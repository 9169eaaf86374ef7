"""Typed errors raised by the shared library.

Services translate them at their edge: the API maps ``code``/``http_status`` to OpenAI-shaped
HTTP errors; workers put ``code`` and the message into an ``ErrorEvent`` for the API. Nothing in
``shared`` knows about HTTP beyond the suggested status carried here.
"""

from __future__ import annotations


class EPDError(Exception):
    """Base class. ``code`` is a stable machine-readable string; ``http_status`` a suggestion."""

    code: str = "internal_error"
    http_status: int = 500
    #: OpenAI error "type" field.
    error_type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


# -- client errors -----------------------------------------------------------------------------
class InvalidRequest(EPDError):
    code = "invalid_request"
    http_status = 400
    error_type = "invalid_request_error"


class UnsupportedContent(InvalidRequest):
    code = "unsupported_content"


class InvalidImage(InvalidRequest):
    """The bytes are not a decodable image, or its size is out of bounds."""

    code = "invalid_image"


class InvalidVideo(InvalidRequest):
    """The bytes are not a decodable video, or its size, length or frames are out of bounds."""

    code = "invalid_video"


class UnsupportedParameter(InvalidRequest):
    """A request parameter this server knows (OpenAI's or vLLM's) but does not honour, set to a
    value that would change the result: refused rather than silently ignored (``param`` names it)."""

    code = "unsupported_parameter"


class UnknownParameter(InvalidRequest):
    """A request field that is in neither OpenAI's nor vLLM's schema of the endpoint (OpenAI refuses
    those too; ``param`` names it)."""

    code = "unknown_parameter"


class PayloadTooLarge(InvalidRequest):
    code = "payload_too_large"


class TooManyImages(InvalidRequest):
    code = "too_many_images"


class URLNotAllowed(InvalidRequest):
    """An image URL that resolves to a private / loopback / link-local target (SSRF guard)."""

    code = "url_not_allowed"


class ImageURLUnavailable(InvalidRequest):
    """An image URL whose server answers 4xx (404, 403, ...) or whose host does not resolve: the
    client's URL is wrong, retrying it will not help (a 400, not a 502 the OpenAI SDK retries)."""

    code = "image_url_unavailable"


class NotFound(EPDError):
    """No such route (or resource) of the API."""

    code = "not_found"
    http_status = 404
    error_type = "invalid_request_error"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(EPDError):
    code = "method_not_allowed"
    http_status = 405
    error_type = "invalid_request_error"


class Unauthorized(EPDError):
    code = "invalid_api_key"
    http_status = 401
    error_type = "authentication_error"


# -- upstream / server errors ------------------------------------------------------------------
class FetchFailed(EPDError):
    """An image URL could not be fetched for a reason upstream (connect, HTTP 5xx, a DNS failure
    other than "no such host"): retrying may help."""

    code = "image_fetch_failed"
    http_status = 502
    error_type = "upstream_error"


class FetchTimeout(FetchFailed):
    code = "image_fetch_timeout"
    http_status = 504


class DeadlineExceeded(EPDError):
    code = "deadline_exceeded"
    http_status = 504
    error_type = "timeout_error"


class Cancelled(EPDError):
    """The caller gave up on the request (disconnected, or the API failed after submitting it).
    HTTP 499 ("client closed request"): nobody is left to receive it; it labels the request's end."""

    code = "cancelled"
    http_status = 499
    error_type = "cancelled"


class ServiceUnavailable(EPDError):
    """A dependency (NATS) does not answer. Transient: workers retry the job, the API answers 503."""

    code = "service_unavailable"
    http_status = 503


class StoreError(EPDError):
    """The object store failed (network, auth). Transient from the caller's point of view."""

    code = "store_error"
    http_status = 503


class MediaMissing(EPDError):
    """A referenced image is not in the object store (expired or never stored)."""

    code = "media_missing"
    http_status = 500


class EngineError(EPDError):
    code = "engine_error"


class ModelMismatch(EPDError):
    """A job prepared by a worker of another model (a deployment error: no retry)."""

    code = "model_mismatch"
    http_status = 500


class KVUnavailable(EPDError):
    """A request's KV state could not be used, even after the allowed re-prefills."""

    code = "kv_unavailable"
    http_status = 502


class ConfigError(EPDError):
    """The deployment's configuration cannot work (a setting the infrastructure cannot honour):
    a process refuses to start with it, naming the setting."""

    code = "config_error"


class WorkerFailed(EPDError):
    """A job exhausted its deliveries: its workers kept crashing or timing out."""

    code = "worker_failed"
    http_status = 502


ERRORS_BY_CODE: dict[str, type[EPDError]] = {}


def _register(cls: type[EPDError]) -> None:
    ERRORS_BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _register(sub)


_register(EPDError)


def error_from_code(code: str, message: str) -> EPDError:
    """Rebuild a typed error from an ``ErrorEvent`` (unknown codes become ``EPDError``)."""
    cls = ERRORS_BY_CODE.get(code, EPDError)
    err = cls(message)
    if cls is EPDError:
        err.code = code
    return err

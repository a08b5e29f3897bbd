"""Errors raised at the engine's boundary; each tells the user which field to fix."""


class MoemeshError(Exception):
    """Base class of the errors moemesh raises on purpose."""


class InvalidRequestError(MoemeshError, ValueError):
    """A request or its sampling parameters are invalid (maps to HTTP 400 / INVALID_ARGUMENT)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelLoadError(MoemeshError):
    """The model path does not exist, or the checkpoint is corrupt or unsupported."""


class ConfigError(MoemeshError, ValueError):
    """An engine configuration value is out of range."""


class ExpertUnavailableError(MoemeshError):
    """A MoE layer's routed experts could not run: an expert worker is unreachable and some
    expert it holds has no replica on a live worker. Raised by a remote ExpertExecutor inside a
    forward; the worker fails the requests of that step with this message (gRPC ABORTED)."""

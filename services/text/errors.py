"""Errors raised at moemesh's boundaries; each tells the user which field to fix."""


class MoemeshError(Exception):
    """Base class of the errors moemesh raises on purpose."""


class InvalidRequestError(MoemeshError, ValueError):
    """A request or its sampling parameters are invalid (maps to HTTP 400 / INVALID_ARGUMENT)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelLoadError(MoemeshError):
    """The model path does not exist, or the checkpoint is corrupt or unsupported."""

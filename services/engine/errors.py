"""Errors raised at the engine's boundary; each tells the user which field to fix. The request
and model-loading errors are the text layer's (`moemesh.text.errors`), shared with the router;
ConfigError is the config definition's (`moemesh.runtime.engine_config`)."""

from moemesh.runtime.engine_config import ConfigError
from moemesh.text.errors import InvalidRequestError, ModelLoadError, MoemeshError

__all__ = ["ConfigError", "ExpertUnavailableError", "InvalidRequestError", "ModelLoadError", "MoemeshError"]


class ExpertUnavailableError(MoemeshError):
    """A MoE layer's routed experts could not run: an expert worker is unreachable and some
    expert it holds has no replica on a live worker. Raised by a remote ExpertExecutor inside a
    forward; the worker fails the requests of that step with this message (gRPC ABORTED)."""

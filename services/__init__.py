"""moemesh: serve Mixture-of-Experts language models as separate services.

`from moemesh import LLM, SamplingParams` gives the offline engine. The names load lazily so
that the operator and router, which never need torch models, import `moemesh.common` cheaply.
"""

from importlib import metadata as _metadata

__all__ = ["LLM", "SamplingParams", "__version__"]

try:
    __version__ = _metadata.version("moemesh")
except _metadata.PackageNotFoundError:  # a source tree without an install
    __version__ = "0.0.0+unknown"


def __getattr__(name: str):
    if name == "LLM":
        from moemesh.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from moemesh.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'moemesh' has no attribute {name!r}")

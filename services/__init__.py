"""moemesh: serve Mixture-of-Experts language models as separate services.

`from moemesh import LLM, SamplingParams` gives the offline engine. The names load lazily so
that the operator and router, which never need torch models, import the torch-free packages cheaply.
"""

from moemesh.runtime.version import VERSION as __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from moemesh.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from moemesh.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'moemesh' has no attribute {name!r}")

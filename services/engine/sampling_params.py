"""The engine's name for the contracts' sampling parameters (contracts/sampling.py), where their
bounds and checks are defined once for the router and the engine."""

from moemesh.contracts.sampling import GREEDY, STRUCTURED_KINDS, SamplingParams, StructuredOutputSpec

__all__ = ["GREEDY", "STRUCTURED_KINDS", "SamplingParams", "StructuredOutputSpec"]

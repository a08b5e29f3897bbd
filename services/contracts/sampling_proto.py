"""SamplingParams <-> the proto `SamplingParams` (common.proto), for the router (which sends it
and validates what gRPC clients send) and the workers (which receive it). Converting from the
proto constructs the contracts' SamplingParams, so every process applies the same checks.

Proto3 scalars have no presence: an unset (0) `top_p` means 1 (disabled), an unset
`temperature` 0 (greedy). Stop strings are not in the proto (the router applies them); they
come from the caller.
"""

from __future__ import annotations

from moemesh.contracts.sampling import SamplingParams, StructuredOutputSpec
from moemesh.proto.v1 import common_pb2
from moemesh.text.errors import InvalidRequestError


def sampling_from_proto(p: common_pb2.SamplingParams, stop: tuple[str, ...] = ()) -> SamplingParams:
    """Raises InvalidRequestError (-> HTTP 400 / INVALID_ARGUMENT) on out-of-range values."""
    return SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens,
        stop_token_ids=tuple(p.stop_token_ids),
        stop=tuple(stop),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(p.logit_bias.items()),
        min_tokens=p.min_tokens,
        structured_output=structured_from_proto(p.structured_output) if p.HasField("structured_output") else None,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Everything but the stop strings."""
    p = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        max_tokens=params.max_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
    )
    if params.seed is not None:
        p.seed = params.seed
    if params.logprobs is not None:
        p.logprobs = params.logprobs
    if params.repetition_penalty != 1.0:
        p.repetition_penalty = params.repetition_penalty
    if params.structured_output is not None:
        p.structured_output.CopyFrom(structured_to_proto(params.structured_output))
    return p


def structured_from_proto(p: common_pb2.StructuredOutput) -> StructuredOutputSpec:
    kind = p.WhichOneof("kind")
    if kind == "choice":
        return StructuredOutputSpec("choice", choices=tuple(p.choice.choices))
    if kind == "json_object":
        return StructuredOutputSpec("json_object")
    if kind is None:
        raise InvalidRequestError("structured_output names no constraint", param="response_format")
    return StructuredOutputSpec("json" if kind == "json_schema" else kind, getattr(p, kind))


def structured_to_proto(spec: StructuredOutputSpec) -> common_pb2.StructuredOutput:
    if spec.kind == "choice":
        return common_pb2.StructuredOutput(choice=common_pb2.StructuredOutput.Choices(choices=spec.choices))
    if spec.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if spec.kind == "json":
        return common_pb2.StructuredOutput(json_schema=spec.spec)
    if spec.kind == "regex":
        return common_pb2.StructuredOutput(regex=spec.spec)
    return common_pb2.StructuredOutput(grammar=spec.spec)

"""A request's validation on the engine's side, done once before it is queued.

Called by `LLMEngine.add_request` (the offline API and the workers' engine thread): tokenize a
text prompt, apply the prompt checks the router applies too (contracts/prompt_checks.py: empty
prompt, token ids in the vocabulary, prompt + max_tokens within the context, the round budget
with chunked prefill off, logit_bias ids), then what only the engine knows: whether its KV pool
can hold the prompt at all, whether the grammar compiles against its vocabulary, and whether a
migrated request's resumed tokens leave something to generate. The sampling parameters were
checked when they were built (contracts/sampling.py). Raises InvalidRequestError naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence

from moemesh.contracts.prompt_checks import PromptLimits, check_request
from moemesh.engine.config import CacheBudget
from moemesh.engine.errors import InvalidRequestError
from moemesh.engine.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, limits: PromptLimits, budget: CacheBudget, structured_outputs):
        """`structured_outputs`: the runner's grammar compiler (compile(spec) raises on a bad one)."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.budget = budget
        self.structured_outputs = structured_outputs

    def process(
        self, prompt: str | list[int], params: SamplingParams, resume_token_ids: Sequence[int] = ()
    ) -> list[int]:
        """The prompt's token ids, once every check passed."""
        prompt_token_ids = self.tokenize(prompt)
        check_request(prompt_token_ids, params, self.limits)
        needed = -(-len(prompt_token_ids) // self.budget.block_size) + 1
        if needed > self.budget.num_usable_blocks:
            raise InvalidRequestError(
                f"prompt needs {needed} KV blocks; the pool has {self.budget.num_usable_blocks}", param="prompt"
            )
        if params.structured_output is not None:  # a bad grammar fails here, not in a round
            self.structured_outputs.compile(params.structured_output)
        if resume_token_ids:
            self._check_resumed(resume_token_ids, params)
        return prompt_token_ids

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; send prompt token ids", param="prompt")
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple) or not all(isinstance(t, int) for t in prompt):
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        return list(prompt)

    def _check_resumed(self, resume_token_ids: Sequence[int], params: SamplingParams) -> None:
        """A migrated request's output so far: fewer than max_tokens, each in the vocabulary."""
        if len(resume_token_ids) >= params.max_tokens:
            raise InvalidRequestError(
                f"{len(resume_token_ids)} resumed tokens leave nothing to generate (max_tokens {params.max_tokens})",
                param="resume_token_ids",
            )
        if any(not 0 <= t < self.limits.vocab_size for t in resume_token_ids):
            raise InvalidRequestError("resumed token ids must be in the vocabulary", param="resume_token_ids")

"""The engine loop: add requests, then `step()` = schedule, execute, update from output.

Single-threaded: callers (the offline LLM, a worker's engine thread) drive `step()`.
"""

from __future__ import annotations

import itertools
import logging

from moemesh.common.block_hash import HashExtra
from moemesh.engine.config import EngineConfig
from moemesh.engine.detokenizer import IncrementalDetokenizer
from moemesh.engine.errors import InvalidRequestError
from moemesh.engine.kv_cache_manager import KVCacheManager
from moemesh.engine.loader import open_checkpoint
from moemesh.engine.loader.build import build_model
from moemesh.engine.model_runner import ModelRunner, measure_cache_budget
from moemesh.engine.outputs import RequestOutput
from moemesh.engine.request import FinishReason, Request
from moemesh.engine.sampling_params import SamplingParams
from moemesh.engine.scheduler import Scheduler
from moemesh.engine.spec.confidence import CostTable
from moemesh.engine.spec.decoder import SpecDecoder

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.config = config
        checkpoint = open_checkpoint(config.model.model)
        self.tokenizer = checkpoint.tokenizer
        self.model = build_model(checkpoint, config.model.dtype, config.model.device, show_progress)
        self.model_id = checkpoint.model_id
        self.max_model_len = min(config.model.max_model_len or 1 << 30, self.model.cfg.max_position)
        self.budget = measure_cache_budget(self.model, config.model, config.cache)
        self.kv_cache_manager = KVCacheManager(
            self.budget.num_blocks,
            self.budget.block_size,
            config.cache.enable_prefix_caching,
            HashExtra(model_id=self.model_id, cache_salt=config.cache.cache_salt),
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.max_model_len)
        self.runner = ModelRunner(self.model, config.model, self.budget)
        self.spec = SpecDecoder(config.spec, self.max_model_len, self._measure_cost_table())
        eos = self.tokenizer.eos_token_id if self.tokenizer else self.model.cfg.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens (%.1f MiB)",
            self.model.cfg.architecture, self.budget.num_blocks, self.budget.block_size,
            self.budget.num_blocks * self.budget.bytes_per_block / 2**20,
        )  # fmt: skip

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError naming the bad field."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        prompt_token_ids = self.tokenize(prompt)
        self._check_prompt(prompt_token_ids)
        request = Request(request_id, prompt_token_ids, sampling_params, eos_token_id=self.eos_token_id)
        self._requests[request_id] = request
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, sampling_params.stop, prompt_token_ids
            )
        self.scheduler.add_request(request)
        return request_id

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; send prompt token ids", param="prompt")
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        return list(prompt)

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens; the context holds {self.max_model_len}, "
                "leaving no room to generate",
                param="prompt",
            )
        vocab = self.model.cfg.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="prompt")
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and len(token_ids) > sched.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                f"({sched.max_num_batched_tokens}) with chunked prefill off",
                param="prompt",
            )
        needed = -(-len(token_ids) // self.budget.block_size) + 1
        if needed > self.budget.num_usable_blocks:
            raise InvalidRequestError(
                f"prompt needs {needed} KV blocks; the pool has {self.budget.num_usable_blocks}", param="prompt"
            )

    def abort_request(self, request_ids) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        finished = self.scheduler.finish_requests(ids, FinishReason.ABORT)
        return [self._output(r, []) for r in finished]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished_requests > 0

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.config.spec.enabled:
            self.spec.prepare(self.scheduler.running)
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        num_before = {rid: len(self.scheduler.requests[rid].output_token_ids)
                      for rid in scheduler_output.num_scheduled_tokens}  # fmt: skip
        updated = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        self.spec.record(scheduler_output.scheduled_spec_token_ids, runner_output.sampled_token_ids)
        return self._process_outputs(updated, runner_output, num_before)

    def _process_outputs(self, updated: list[Request], runner_output, num_before: dict[str, int]) -> list[RequestOutput]:
        outputs, stopped, new_tokens = [], [], {}
        for request in updated:
            logprob = runner_output.logprobs.get(request.request_id)
            if logprob is not None:
                request.output_logprobs.append(logprob)
            start = num_before[request.request_id]
            detok = self._detokenizers.get(request.request_id)
            if detok is not None and not detok.stopped:
                for i in range(start, request.num_output_tokens):
                    detok.append(request.output_token_ids[i])
                    if detok.stopped:  # drop tokens a speculative round produced past the stop
                        del request.output_token_ids[i + 1 :]
                        if not request.is_finished:
                            stopped.append(request)
                        break
            new_tokens[request.request_id] = request.output_token_ids[start:]
        for request in stopped:  # stop string found: finish now, freeing blocks
            self.scheduler.finish_requests([request.request_id], FinishReason.STOP)
        for request in updated:
            outputs.append(self._output(request, new_tokens[request.request_id]))
        return outputs

    def _measure_cost_table(self) -> CostTable | None:
        """Seconds per decode round by token count, for confidence-scheduled speculation."""
        spec = self.config.spec
        if not spec.enabled or spec.scheduling != "confidence":
            return None
        # decode rounds verify at most max_num_seqs * (k + 1) tokens; beyond 64 the table extrapolates
        max_tokens = min(self.config.scheduler.max_num_seqs * (spec.num_speculative_tokens + 1), 64)
        counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_tokens]
        return CostTable(tuple(counts), tuple(self.runner.measure_step_seconds(counts)))

    def _output(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        detok = self._detokenizers.get(request.request_id)
        finished = request.is_finished
        output = RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=detok.text if detok else "",
            new_token_ids=new_token_ids,
            new_text=detok.delta(finished) if detok else "",
            logprobs=list(request.output_logprobs) if request.sampling_params.logprobs is not None else None,
            finished=finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )
        if finished:
            self._requests.pop(request.request_id, None)
            self._detokenizers.pop(request.request_id, None)
        return output

    # -- observability ---------------------------------------------------------------------
    def stats(self) -> dict:
        kv = self.kv_cache_manager
        return {
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_blocks_total": self.budget.num_usable_blocks,
            "num_blocks_used": kv.num_used_blocks,
            "kv_usage": kv.usage,
            "prefix_cache_queries": kv.stats.num_queries,
            "prefix_cache_hits": kv.stats.num_hits,
            "prefix_cache_evictions": kv.num_evictions,
            "num_preemptions": self.scheduler.num_preemptions,
            "spec_acceptance_rate": self.spec.stats.acceptance_rate,
            "spec_mean_accepted_length": self.spec.stats.mean_accepted_length,
            "spec_draft_tokens_per_round": self.spec.stats.drafts_per_round,
        }

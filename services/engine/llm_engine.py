"""The engine loop: add requests, then `step()` = schedule, execute, update from output.

Callers (the offline LLM, a worker's engine thread) drive `step()` from one thread. With
execution overlap (`SchedulerConfig.async_scheduling`, the default without speculation) the
model runs on a runner thread: `step()` schedules round t+1 while round t runs, then processes
round t's outputs (placeholders resolved, detokenization, stop checks) while t+1 runs. Only the
runner thread touches the runner; only the caller's thread touches the scheduler.

KV moving in or out of the paged cache (remote prefill, offload tiers) is the KV connector's
(connectors/base.py; the NullConnector by default): the scheduler calls its scheduler half, and
each step calls its worker half: `get_finished` at the start (loads that ended let their requests
run) and after each round, `start_load_kv` just before a round runs, `save_kv` once its outputs are
processed. Requests carry the connector's parameters in `kv_transfer_params`; the caller reads the
connector's events (`take_connector_events`) after each step.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moemesh.contracts.block_hash import HashExtra
from moemesh.contracts.prompt_checks import PromptLimits
from moemesh.engine.config import EngineConfig
from moemesh.engine.connectors.base import KVConnector, KVConnectorEvent, KVTransferParams, NullConnector, kv_caches
from moemesh.engine.core.kv_cache_manager import KVCacheManager
from moemesh.engine.core.request import FinishReason, Logprob, Request
from moemesh.engine.core.scheduler import Scheduler
from moemesh.engine.core.scheduler_output import SchedulerOutput
from moemesh.engine.dtype import resolve_dtype
from moemesh.engine.errors import InvalidRequestError
from moemesh.engine.input_processor import InputProcessor
from moemesh.engine.loader import open_checkpoint
from moemesh.engine.loader.build import build_model
from moemesh.engine.outputs import RequestDelta
from moemesh.engine.runner.model_runner import ModelRunner, ModelRunnerOutput, measure_cache_budget
from moemesh.engine.runner.structured_output import StructuredOutputs
from moemesh.engine.sampling_params import SamplingParams
from moemesh.engine.speculative.confidence import CostTable
from moemesh.engine.speculative.decoder import SpecDecoder
from moemesh.text.output_processor import OutputProcessor

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True, kv_connector: KVConnector | None = None):
        # "auto" resolved once here; the engine's components see the concrete dtype
        dtype = resolve_dtype(config.model.dtype, config.model.device)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype))
        self.config = config
        checkpoint = open_checkpoint(config.model.model)
        self.tokenizer = checkpoint.tokenizer
        self.model = build_model(
            checkpoint,
            config.model.dtype,
            config.model.device,
            show_progress,
            config.model.load_routed_experts,
            config.model.quantization,
        )
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
        if self.tokenizer is not None:
            self.runner.structured_outputs = StructuredOutputs(self.tokenizer, self.model.cfg.vocab_size)
        sched = config.scheduler
        max_prefill_tokens = None if sched.enable_chunked_prefill else sched.max_num_batched_tokens
        limits = PromptLimits(self.max_model_len, self.model.cfg.vocab_size, max_prefill_tokens)
        self.input_processor = InputProcessor(self.tokenizer, limits, self.budget, self.runner.structured_outputs)
        self.kv_caches = kv_caches(self.model, self.model_id, self.budget.block_size)
        self.spec = SpecDecoder(
            config.spec,
            self.max_model_len,
            self._measure_cost_table(),
            config.model,
            self.model.cfg.vocab_size,
            self.model,
        )
        self.runner.keep_hidden_states = self.spec.needs_hidden_states
        # execution overlap: one runner thread, at most two rounds in flight (one running, one queued)
        self._overlap: ThreadPoolExecutor | None = None
        self._in_flight: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        if config.scheduler.async_scheduling:
            if config.spec.enabled:
                logger.info("speculative decoding is on: rounds run without execution overlap")
            else:
                self._overlap = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moemesh-runner")
        device = torch.device(config.model.device)
        self._stream = torch.cuda.Stream(device) if self._overlap is not None and device.type == "cuda" else None
        eos = self.tokenizer.eos_token_id if self.tokenizer else self.model.cfg.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self._output_processors: dict[str, OutputProcessor] = {}  # detokenized requests
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.set_kv_connector(kv_connector if kv_connector is not None else NullConnector())
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens (%.1f MiB)",
            self.model.cfg.architecture,
            self.budget.num_blocks,
            self.budget.block_size,
            self.budget.num_blocks * self.budget.bytes_per_block / 2**20,
        )

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        *,
        kv_transfer_params: KVTransferParams | None = None,
        detokenize: bool = True,
        resume_token_ids: list[int] = (),
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError naming the bad field.
        `kv_transfer_params`: the KV connector's parameters for it (e.g. a remote prefill).
        `detokenize=False`: no text or stop strings here (a worker; the router detokenizes).
        `resume_token_ids`: output tokens another worker generated (a migrated request): it is
        admitted like a preempted one, its prompt and these tokens prefilled, and continues."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        prompt_token_ids = self.input_processor.process(prompt, sampling_params, resume_token_ids)
        resume = list(resume_token_ids)
        request = Request(request_id, prompt_token_ids, sampling_params, eos_token_id=self.eos_token_id)
        request.output_token_ids = resume
        request.kv_transfer_params = kv_transfer_params
        self.kv_connector.check_request(request)
        self._requests[request_id] = request
        if self.tokenizer is not None and detokenize:
            self._output_processors[request_id] = OutputProcessor(
                self.tokenizer, sampling_params.stop, prompt_token_ids, sampling_params.min_tokens
            )
        self.scheduler.add_request(request)
        return request_id

    def abort_request(self, request_ids) -> list[RequestDelta]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        finished = self.scheduler.finish_requests(ids, FinishReason.ABORT)
        return [self._emit(r, r.num_output_tokens, None) for r in finished]

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a round still in flight (its outputs are not processed)."""
        return self.scheduler.num_unfinished_requests > 0 or bool(self._in_flight)

    # -- the KV connector ------------------------------------------------------------------
    def set_kv_connector(self, connector: KVConnector) -> None:
        """Plug in the KV connector (while no request is unfinished or held): it gets the paged
        KV, and the scheduler calls it from the next admission on."""
        assert not self.has_unfinished_requests() and not self.scheduler.kv_held, "only between requests"
        connector.register_kv_caches(self.kv_caches)
        self.kv_connector = self.scheduler.kv_connector = connector

    def take_connector_events(self) -> list[KVConnectorEvent]:
        """Connector events since the last call, for the requests' streams: loads started and
        finished (the scheduler's) and the connector's own (e.g. KV handed out)."""
        return self.scheduler.take_events() + self.kv_connector.take_events()

    def _update_from_connector(self) -> list[RequestDelta]:
        """Hand the scheduler what the connector finished: saved requests' blocks are freed,
        loaded requests run; a load that brought the first token gives its request's delta."""
        finished = self.kv_connector.get_finished()
        if not finished:
            return []
        waiting = self.scheduler.waiting_for_kv
        num_before = {rid: waiting[rid].num_output_tokens for rid in finished.loads if rid in waiting}
        firsts = [(rid, load.first_token) for rid, load in finished.loads.items() if load.first_token is not None]
        logprobs = {rid: first.logprob for rid, first in firsts if first.logprob is not None}
        updated = self.scheduler.update_from_connector(finished)
        return self._process_outputs(updated, logprobs, num_before)

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """One round: schedule, run the model, process its outputs (after the loads the KV
        connector finished since the last step, whose requests can then run). With overlap,
        schedule round t+1 and hand it to the runner thread, then process round t (which ran
        meanwhile); the first call only starts the pipeline."""
        outputs = self._update_from_connector()
        if self._overlap is not None:
            return outputs + self._step_overlapped()
        if self.config.spec.enabled:
            self.spec.prepare(self.scheduler.running)
        scheduler_output = self.scheduler.schedule()
        runner_output = self._run_round(scheduler_output)
        return outputs + self._finish_round(scheduler_output, runner_output)

    def _step_overlapped(self) -> list[RequestDelta]:
        in_flight = self._in_flight
        submitted = False
        if len(in_flight) < 2 and self.scheduler.has_schedulable_requests:
            scheduler_output = self.scheduler.schedule()  # while the previous round runs
            in_flight.append((scheduler_output, self._overlap.submit(self._run_round, scheduler_output)))
            submitted = True
        if not in_flight or (submitted and len(in_flight) == 1):
            return []
        scheduler_output, future = in_flight.popleft()
        return self._finish_round(scheduler_output, future.result())

    def _run_round(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The connector's loads for the round, then the round (on the runner thread with overlap).
        On CUDA with overlap the round runs on the runner's own stream, after the work the
        caller's thread queued on the default stream (e.g. KV written by a transfer)."""
        metadata = scheduler_output.kv_connector_metadata
        if self._stream is None:
            self.kv_connector.start_load_kv(metadata)
            return self.runner.execute(scheduler_output)
        self._stream.wait_stream(torch.cuda.default_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            self.kv_connector.start_load_kv(metadata)
            return self.runner.execute(scheduler_output)

    def _finish_round(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestDelta]:
        requests = self.scheduler.requests
        num_before = {
            rid: len(requests[rid].output_token_ids) for rid in scheduler_output.num_scheduled_tokens if rid in requests
        }
        updated = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        self.spec.record(
            scheduler_output.scheduled_spec_token_ids, runner_output.sampled_token_ids, runner_output.hidden_states
        )
        outputs = self._process_outputs(updated, runner_output.logprobs, num_before)
        self.kv_connector.save_kv(scheduler_output.kv_connector_metadata)  # first tokens and logprobs known
        return outputs + self._update_from_connector()

    @property
    def has_steppable_work(self) -> bool:
        """Something for `step()` to do: a schedulable request, a round in flight, or a transfer
        the KV connector finished."""
        return self.scheduler.has_schedulable_requests or bool(self._in_flight) or self.kv_connector.has_finished

    def shutdown(self) -> None:
        """Finish the round in flight and stop the runner thread (overlap only)."""
        if self._overlap is not None:
            for _, future in self._in_flight:
                if future.exception() is not None:  # waits; a failed round was already reported
                    logger.warning("a round in flight at shutdown failed: %s", future.exception())
            self._in_flight.clear()
            self._overlap.shutdown()

    def _process_outputs(
        self, updated: list[Request], logprobs: dict, num_before: dict[str, int]
    ) -> list[RequestDelta]:
        return [self._emit(r, num_before[r.request_id], logprobs.get(r.request_id)) for r in updated]

    def _measure_cost_table(self) -> CostTable | None:
        """Seconds per decode round by token count, for confidence-scheduled speculation."""
        spec = self.config.spec
        if not spec.enabled or spec.scheduling != "confidence":
            return None
        # decode rounds verify at most max_num_seqs * (k + 1) tokens; beyond 64 the table extrapolates
        max_tokens = min(self.config.scheduler.max_num_seqs * (spec.num_speculative_tokens + 1), 64)
        counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_tokens]
        return CostTable(tuple(counts), tuple(self.runner.measure_step_seconds(counts)))

    def _emit(self, request: Request, start: int, logprob: Logprob | None) -> RequestDelta:
        """The request's delta: its output tokens from `start` on and this step's logprob; with
        detokenization, their text, cut at a stop string (which finishes the request, and drops
        the tokens a speculative round produced past it). Work per call: the new tokens only."""
        new_token_ids = request.output_token_ids[start:]
        if logprob is not None:
            request.output_logprobs.append(logprob)
        processor = self._output_processors.get(request.request_id)
        new_text = ""
        if processor is not None:
            out = processor.process(new_token_ids, request.is_finished)
            if out.num_kept < len(new_token_ids):
                del request.output_token_ids[start + out.num_kept :]
                new_token_ids = new_token_ids[: out.num_kept]
            if out.stopped and not request.is_finished:  # finish now, freeing its blocks
                self.scheduler.finish_requests([request.request_id], FinishReason.STOP)
            new_text = out.text
        new_logprobs = None  # not requested
        if request.sampling_params.logprobs is not None:
            new_logprobs = [logprob] if logprob is not None else []
        finished = request.is_finished
        if finished:
            self._requests.pop(request.request_id, None)
            self._output_processors.pop(request.request_id, None)
        return RequestDelta(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            new_text=new_text,
            num_output_tokens=request.num_output_tokens,
            finished=finished,
            finish_reason=request.finish_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            scheduled_time=request.scheduled_time,
        )

    # -- observability ---------------------------------------------------------------------
    def stats(self) -> dict:
        kv = self.kv_cache_manager
        return {
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_waiting_for_kv": len(self.scheduler.waiting_for_kv),
            "num_kv_held": len(self.scheduler.kv_held),
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

"""The engine loop: add requests, then `step()` = schedule, execute, update from output.

Callers (the offline LLM, a worker's engine thread) drive `step()` from one thread. With
execution overlap (`SchedulerConfig.async_scheduling`, the default without speculation) the
model runs on a runner thread: `step()` schedules round t+1 while round t runs, then processes
round t's outputs (placeholders resolved, detokenization, stop checks) while t+1 runs. Only the
runner thread touches the runner; only the caller's thread touches the scheduler.

Disaggregated serving (called by a worker's engine thread between steps, see kv_transfer.py):
a decode worker adds requests with `remote_prefill`, reads `take_remote_prefills()` after each
step, and completes each with `finish_remote_prefill` (or `fallback_to_local_prefill`, keeping
the KV received before the failure); a prefill worker adds requests with `kv_export_start` and
calls `take_kv_exports()` after each step for the KV its rounds completed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moemesh.contracts.block_hash import HashExtra
from moemesh.engine.config import EngineConfig
from moemesh.engine.connectors.kv_export import KVExporter
from moemesh.engine.connectors.kv_transfer import (
    ExportedKV,
    KVLayout,
    KVPiece,
    RemoteKV,
    cache_tensors,
    kv_layout,
    scatter_kv,
)
from moemesh.engine.core.kv_cache_manager import KVCacheManager
from moemesh.engine.core.request import FinishReason, RemotePrefillParams, Request
from moemesh.engine.core.scheduler import Scheduler
from moemesh.engine.core.scheduler_output import SchedulerOutput
from moemesh.engine.dtype import resolve_dtype
from moemesh.engine.errors import InvalidRequestError
from moemesh.engine.loader import open_checkpoint
from moemesh.engine.loader.build import build_model
from moemesh.engine.outputs import RequestOutput
from moemesh.engine.runner.model_runner import ModelRunner, ModelRunnerOutput, measure_cache_budget
from moemesh.engine.runner.structured_output import StructuredOutputs
from moemesh.engine.sampling_params import SamplingParams
from moemesh.engine.speculative.confidence import CostTable
from moemesh.engine.speculative.decoder import SpecDecoder
from moemesh.text.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
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
        self.kv_layout: KVLayout = kv_layout(self.model, self.model_id)
        self.kv_exporter = KVExporter(self.scheduler, cache_tensors(self.model))
        self.spec = SpecDecoder(config.spec, self.max_model_len, self._measure_cost_table(),
                                config.model, self.model.cfg.vocab_size, self.model)  # fmt: skip
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
        *,
        remote_prefill: RemotePrefillParams | None = None,
        kv_export_start: int | None = None,
        detokenize: bool = True,
        resume_token_ids: list[int] = (),
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError naming the bad field.
        `remote_prefill`: a decode worker may get the prompt's KV from a prefill worker.
        `kv_export_start`: a prefill worker hands out the KV from that token (`take_kv_exports`).
        `detokenize=False`: no text or stop strings here (a worker; the router detokenizes).
        `resume_token_ids`: output tokens another worker generated (a migrated request): it is
        admitted like a preempted one, its prompt and these tokens prefilled, and continues."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        prompt_token_ids = self.tokenize(prompt)
        self._check_prompt(prompt_token_ids)
        vocab = self.model.cfg.vocab_size
        if any(t >= vocab for t, _ in sampling_params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
        if sampling_params.structured_output is not None:  # a bad grammar fails here, not in a round
            self.runner.structured_outputs.compile(sampling_params.structured_output)
        if kv_export_start is not None and not 0 <= kv_export_start < len(prompt_token_ids):
            raise InvalidRequestError(
                f"kv_export_start must be in [0, {len(prompt_token_ids)}), got {kv_export_start}",
                param="kv_export_start",
            )
        resume = list(resume_token_ids)
        if resume and (len(resume) >= sampling_params.max_tokens or remote_prefill is not None or
                       len(prompt_token_ids) + len(resume) >= self.max_model_len):  # fmt: skip
            raise InvalidRequestError(
                f"{len(resume)} resumed tokens leave nothing to generate (max_tokens {sampling_params.max_tokens}, "
                f"context {self.max_model_len}) or come with a remote prefill", param="resume_token_ids")  # fmt: skip
        if any(not 0 <= t < vocab for t in resume):
            raise InvalidRequestError("resumed token ids must be in the vocabulary", param="resume_token_ids")
        request = Request(request_id, prompt_token_ids, sampling_params, eos_token_id=self.eos_token_id)
        request.output_token_ids = resume
        request.remote_prefill = remote_prefill
        request.kv_export_start = kv_export_start
        self._requests[request_id] = request
        if self.tokenizer is not None and detokenize:
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, sampling_params.stop, prompt_token_ids, sampling_params.min_tokens
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
        for request_id in ids:
            self.scheduler.release_held(request_id)
        self.kv_exporter.forget(ids)
        return [self._output(r, []) for r in finished]

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a round still in flight (its outputs are not processed)."""
        return self.scheduler.num_unfinished_requests > 0 or bool(self._in_flight)

    # -- disaggregated prefill -------------------------------------------------------------
    def take_remote_prefills(self) -> list[Request]:
        """Decode: requests parked for remote KV since the last call; fetch each one's KV for
        tokens [request.num_computed_tokens, num_prompt_tokens)."""
        return self.scheduler.take_remote_prefills()

    def finish_remote_prefill(self, request_id: str, kv: RemoteKV) -> list[RequestOutput]:
        """Decode: write the received KV (a complete transfer) into the request's blocks and
        append the first token. Returns the request's output (none if it was aborted meanwhile)."""
        request = self.scheduler.waiting_for_kv.get(request_id)
        if request is None:
            return []
        if not kv.complete or (kv.start, kv.end) != (request.num_computed_tokens, request.num_prompt_tokens):
            raise ValueError(f"expected the KV of tokens [{request.num_computed_tokens}, {request.num_prompt_tokens}) "
                             f"and the first token, got [{kv.start}, {kv.end}) complete={kv.complete}")  # fmt: skip
        self._write_kv(request_id, kv.pieces)
        request.num_remote_prefill_tokens = kv.end - kv.start
        first = kv.first_token
        request.num_cached_tokens = max(request.num_cached_tokens, first.num_cached_tokens)
        num_before = {request_id: request.num_output_tokens}
        self.scheduler.finish_remote_prefill(request_id, first.token_id)
        logprobs = {request_id: first.logprob} if first.logprob is not None else {}
        return self._process_outputs([request], logprobs, num_before)

    def fallback_to_local_prefill(self, request_id: str, kv: RemoteKV | None = None) -> int:
        """Decode: the transfer failed. Keep the KV received in `kv` (its whole pieces before the
        last prompt token, whose logits the local prefill needs) and prefill the rest here.
        Returns the number of tokens kept."""
        request = self.scheduler.waiting_for_kv.get(request_id)
        if request is None:
            return 0
        pieces = kv.pieces_before(request.num_prompt_tokens - 1) if kv is not None else []
        assert not pieces or pieces[0].start == request.num_computed_tokens, "the KV continues the computed tokens"
        self._write_kv(request_id, pieces)
        num_kept = sum(p.num_tokens for p in pieces)
        request.num_remote_prefill_tokens = num_kept
        self.scheduler.fallback_to_local_prefill(request_id, num_kept)
        return num_kept

    def _write_kv(self, request_id: str, pieces: list[KVPiece]) -> None:
        tensors, kv_manager = cache_tensors(self.model), self.kv_cache_manager
        block_ids = kv_manager.get_block_ids(request_id)
        for piece in pieces:
            scatter_kv(tensors, block_ids, kv_manager.block_size, piece.start, piece.end, piece.data)

    def take_kv_exports(self) -> list[ExportedKV]:
        """Prefill: the KV that `kv_export_start` requests completed since the last call (whole
        blocks while they run; the tail and the first token once finished, their blocks freed)."""
        return self.kv_exporter.take()

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One round: schedule, run the model, process its outputs. With overlap, schedule round
        t+1 and hand it to the runner thread, then process round t (which ran meanwhile); the
        first call only starts the pipeline and returns nothing."""
        if self._overlap is not None:
            return self._step_overlapped()
        if self.config.spec.enabled:
            self.spec.prepare(self.scheduler.running)
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        return self._finish_round(scheduler_output, runner_output)

    def _step_overlapped(self) -> list[RequestOutput]:
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
        """On the runner thread. On CUDA the round runs on the runner's own stream, after the
        work the caller's thread queued on the default stream (e.g. KV written by a transfer)."""
        if self._stream is None:
            return self.runner.execute(scheduler_output)
        self._stream.wait_stream(torch.cuda.default_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            return self.runner.execute(scheduler_output)

    def _finish_round(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        requests = self.scheduler.requests
        num_before = {rid: len(requests[rid].output_token_ids)
                      for rid in scheduler_output.num_scheduled_tokens if rid in requests}  # fmt: skip
        updated = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        self.kv_exporter.record_round(scheduler_output)
        self.spec.record(scheduler_output.scheduled_spec_token_ids, runner_output.sampled_token_ids,
                         runner_output.hidden_states)  # fmt: skip
        return self._process_outputs(updated, runner_output.logprobs, num_before)

    @property
    def has_steppable_work(self) -> bool:
        """Something for `step()` to do: a schedulable request or a round in flight."""
        return self.scheduler.has_schedulable_requests or bool(self._in_flight)

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
    ) -> list[RequestOutput]:
        outputs, stopped, new_tokens = [], [], {}
        for request in updated:
            logprob = logprobs.get(request.request_id)
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
            scheduled_time=request.scheduled_time,
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

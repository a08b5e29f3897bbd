"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from tqdm import tqdm

from moemesh.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from moemesh.engine.llm_engine import LLMEngine
from moemesh.engine.loader import default_model_path
from moemesh.engine.outputs import RequestOutput
from moemesh.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        max_model_len: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_memory_gib: float = 2.0,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        async_scheduling: bool = True,
        seed: int = 0,
        speculative: SpecConfig | None = None,
        show_progress: bool = True,
        micro_batch_overlap: bool | None = None,  # MoE ping-pong; None: with remote experts only
        quantization: str = "auto",  # GGUF weights: "gguf" keep quantized, "none" dequantize, "auto"
    ):
        config = EngineConfig(
            model=ModelConfig(
                model or default_model_path(),
                dtype,
                device,
                max_model_len,
                seed,
                micro_batch_overlap=micro_batch_overlap,
                quantization=quantization,
            ),
            cache=CacheConfig(block_size, num_blocks, kv_memory_gib, enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, async_scheduling),
            spec=speculative or SpecConfig(),
        )
        self.engine = LLMEngine(config, show_progress=show_progress)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            self.engine.abort_request(ids)  # nothing half-applied
            raise
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

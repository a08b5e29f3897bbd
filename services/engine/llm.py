"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import inspect
from typing import Any

from tqdm import tqdm

from moemesh.engine.config import EngineConfig, SpecConfig
from moemesh.engine.errors import ConfigError
from moemesh.engine.llm_engine import LLMEngine
from moemesh.engine.outputs import OutputCollector, RequestOutput
from moemesh.engine.sampling_params import SamplingParams
from moemesh.runtime.engine_config import BY_NAME, OPTIONS, build, with_default_model

Prompt = str | list[int]


class LLM:
    """The offline engine. Its options are the config definition's (`moemesh.runtime.engine_config`),
    by name: `LLM(model, dtype="float32", num_blocks=256, enable_prefix_caching=False, ...)`;
    `inspect.signature(LLM)` lists them with their defaults. Speculation by the `speculative_*` /
    `draft_*` / `ngram_*` options, or as a whole `speculative=SpecConfig(...)`."""

    def __init__(
        self,
        model: str | None = None,
        *,
        speculative: SpecConfig | None = None,
        show_progress: bool = True,
        **options: Any,
    ):
        config = llm_config(model, speculative, options)
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
        collector = OutputCollector()  # the steps' deltas, added up per request
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in collector.add(self.engine.step()):
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


def llm_config(model: str | None, speculative: SpecConfig | None, options: dict[str, Any]) -> EngineConfig:
    """LLM(...)'s EngineConfig (ConfigError for a bad value, TypeError for an unknown option); the
    model unset: the default model."""
    unknown = sorted(set(options) - set(BY_NAME) - {"model"})
    if unknown:
        raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
    base = None
    if speculative is not None:
        both = [name for name in options if BY_NAME[name].group == "spec"]
        if both:
            raise ConfigError(f"pass speculative=SpecConfig(...) or {both[0]}=..., not both")
        base = EngineConfig(spec=speculative)
    return with_default_model(build({"model": model, **options}, base))


def _signature() -> inspect.Signature:
    """LLM.__init__'s signature as help() and inspect show it: every option, generated."""
    keyword, positional = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("self", positional)]
    params.append(inspect.Parameter("model", positional, default=None, annotation="str | None"))
    for o in OPTIONS:
        if o.name != "model":
            kind = o.kind.__name__ + (" | None" if o.nullable else "")
            params.append(inspect.Parameter(o.name, keyword, default=o.default, annotation=kind))
    params.append(inspect.Parameter("speculative", keyword, default=None, annotation="SpecConfig | None"))
    params.append(inspect.Parameter("show_progress", keyword, default=True, annotation="bool"))
    return inspect.Signature(params)


LLM.__init__.__signature__ = _signature()  # type: ignore[attr-defined]

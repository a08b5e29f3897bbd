"""Multi-token-prediction speculation (`SpecConfig(method="mtp")`) on tiny random DeepSeek-V3
checkpoints built with transformers, to which the tests add one MTP layer's tensors
(`model.layers.1.*`, as DeepSeek's checkpoints store layer 61; transformers has no MTP layer):
greedy output is token-identical to no speculation, an MTP layer that repeats the main model is
accepted nearly always, the proposer's drafts and confidences match a float64 re-implementation
built on transformers' own decoder layer, and a model without an MTP layer is a ConfigError."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from moemesh import LLM, SamplingParams
from moemesh.cli import build_parser
from moemesh.engine.config import SpecConfig
from moemesh.engine.errors import ConfigError
from moemesh.engine.loader import open_checkpoint
from moemesh.engine.loader.build import build_model, build_mtp_model
from moemesh.engine.runner.hidden_states import TargetHiddenStates
from moemesh.engine.speculative.confidence import CostTable
from moemesh.engine.speculative.mtp import MtpProposer
from moemesh.worker.settings import worker_settings

from ..moe.models import VOCAB, _common, hf_greedy
from .conftest import save_tiny_llama

MAX_NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPT_LENGTHS = (5, 9, 14, 20)
MTP = "model.layers.1."  # the MTP layer of a 1-layer model: layer num_hidden_layers + 0


def build_one_layer_deepseek(seed: int):
    """A 1-layer DeepSeek-V3 whose only layer is MoE (first_k_dense_replace 0, like the MTP
    layer of the released checkpoint), with unit-RMS embedding rows (see `copy_construction`)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        **_common(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=1,
            num_key_value_heads=4,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=0,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
        )
    )
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        gate = model.model.layers[0].mlp.gate
        gate.e_score_correction_bias.copy_(0.3 * torch.randn(gate.e_score_correction_bias.shape))
        embed = model.model.embed_tokens.weight
        embed.copy_(embed / embed.pow(2).mean(-1, keepdim=True).sqrt())
    return model


def copy_construction(main_weights: dict[str, torch.Tensor], hidden: int) -> dict[str, torch.Tensor]:
    """An MTP layer that predicts exactly what the main model predicts one step later.

    The decoder layer is a copy of main layer 0, eh_proj = [I | 0] ignores the hidden state, so
    x = enorm(Emb(t_{i+1})) with enorm's weight ones; the main model's embedding rows have RMS 1,
    so x = Emb(t_{i+1}) (up to eps) is exactly what main layer 0 reads at position i+1.
    shared_head.norm is model.norm and the head is lm_head, so the MTP layer at position i sees
    the tokens t_1..t_{i+1} at positions 0..i, the main model at position i+1 sees t_0..t_{i+1}
    at positions 0..i+1: RoPE is relative, so the two differ only by t_0 missing from the MTP
    layer's attention context, and the MTP argmax is the main model's next token nearly always
    (drafts 2..k feed the MTP layer's own drafts the same way)."""
    weights = {k.replace("model.layers.0.", MTP): v.clone() for k, v in main_weights.items() if ".layers.0." in k}
    weights[MTP + "enorm.weight"] = torch.ones(hidden)
    weights[MTP + "hnorm.weight"] = torch.ones(hidden)
    weights[MTP + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    weights[MTP + "shared_head.norm.weight"] = main_weights["model.norm.weight"].clone()
    return weights


def random_construction(mtp_source, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """Random MTP weights: the decoder layer of another random model, random norms and eh_proj."""
    gen = torch.Generator().manual_seed(seed)
    weights = {
        MTP + k.removeprefix("model.layers.0."): v.clone()
        for k, v in mtp_source.state_dict().items()
        if k.startswith("model.layers.0.")
    }
    weights[MTP + "enorm.weight"] = 1 + 0.3 * torch.randn(hidden, generator=gen)
    weights[MTP + "hnorm.weight"] = 1 + 0.3 * torch.randn(hidden, generator=gen)
    weights[MTP + "eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=gen)
    weights[MTP + "shared_head.norm.weight"] = 1 + 0.3 * torch.randn(hidden, generator=gen)
    return weights


def save_with_mtp(path: str, construction: str, seed: int = 0):
    """Save a 1-layer DeepSeek-V3 plus an MTP layer; returns (HF main model, HF model whose
    layer 0 is the MTP decoder layer, MTP weights as stored)."""
    main = build_one_layer_deepseek(seed)
    main.save_pretrained(path)
    main_weights = load_file(os.path.join(path, "model.safetensors"))
    hidden = main.config.hidden_size
    if construction == "copy":
        source, weights = main, copy_construction(main_weights, hidden)
    else:
        source = build_one_layer_deepseek(seed + 1)
        weights = random_construction(source, hidden, seed + 2)
    # DeepSeek's checkpoints also store the shared embedding and head in the MTP layer
    weights[MTP + "embed_tokens.weight"] = main_weights["model.embed_tokens.weight"].clone()
    weights[MTP + "shared_head.head.weight"] = main_weights["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "mtp.safetensors"))
    set_num_mtp_layers(path, 1)
    return main, source, weights


def set_num_mtp_layers(path: str, num_layers: int | None) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.pop("num_nextn_predict_layers", None)
    if num_layers is not None:
        config["num_nextn_predict_layers"] = num_layers
    with open(config_path, "w") as f:
        json.dump(config, f)


def make_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _llm(path: str, spec: SpecConfig | None = None, **kw) -> LLM:
    kw = {"block_size": 4, "num_blocks": 256, "show_progress": False} | kw
    return LLM(path, speculative=spec, **kw)


@pytest.fixture(scope="module")
def one_thread():
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def copy_checkpoint(tmp_path_factory, one_thread):
    path = str(tmp_path_factory.mktemp("mtp_copy"))
    main, _, _ = save_with_mtp(path, "copy")
    prompts = make_prompts()
    return path, prompts, [hf_greedy(main, p, MAX_NEW) for p in prompts]


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory, one_thread):
    path = str(tmp_path_factory.mktemp("mtp_random"))
    main, source, weights = save_with_mtp(path, "random", seed=3)
    return path, main, source, weights


# -- engine: output unchanged, acceptance -----------------------------------------------------


@pytest.mark.parametrize(
    "scheduling, budget, min_accepted_length",
    # DSpark: the tiny model's probabilities are flat (~0.3), so it mostly verifies one draft per round
    [("fixed", 2048, 3.0), ("confidence", 16, 1.8)],
    ids=["fixed", "chunked-dspark"],
)
def test_mtp_layer_that_repeats_the_main_model_is_accepted_and_output_is_unchanged(
    copy_checkpoint, scheduling, budget, min_accepted_length
):
    path, prompts, expected = copy_checkpoint
    assert [o.token_ids for o in _llm(path).generate(prompts, GREEDY)] == expected  # no speculation = transformers
    spec = SpecConfig(method="mtp", num_speculative_tokens=3, scheduling=scheduling, draft_kv_memory_gib=0.01)
    llm = _llm(path, spec, max_num_batched_tokens=budget, max_num_seqs=4)  # 16: the prompts are prefilled in chunks
    llm.engine.spec.cost = CostTable((1, 16), (1.0, 1.2))  # not the measured one: deterministic choices
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    stats = llm.engine.stats()
    assert llm.engine.spec.stats.num_draft_tokens > 0
    assert stats["spec_acceptance_rate"] > 0.8
    assert stats["spec_mean_accepted_length"] > min_accepted_length
    assert llm.engine.kv_cache_manager.num_used_blocks == 0


def test_random_mtp_weights_keep_greedy_output_identical(random_checkpoint):
    path = random_checkpoint[0]
    prompts = make_prompts()
    reference = [o.token_ids for o in _llm(path).generate(prompts, GREEDY)]
    spec = SpecConfig(method="mtp", num_speculative_tokens=4, scheduling="fixed", draft_kv_memory_gib=0.01)
    llm = _llm(path, spec)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
    second = llm.generate(prompts, GREEDY)  # prefix-cache hits: MTP windows start after the cached blocks
    assert [o.token_ids for o in second] == reference
    assert sum(o.num_cached_tokens for o in second) > 0
    spec_stats = llm.engine.spec.stats
    assert spec_stats.num_draft_tokens > 0 and spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens


# -- numerics: the proposer against a float64 re-implementation ------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Float64MTP:
    """MTP in float64, recomputed over the whole sequence: the hand-written fusion and norms of
    DeepSeek's description, transformers' DeepseekV3DecoderLayer (eager attention) in between."""

    def __init__(self, main, source, weights: dict[str, torch.Tensor]):
        self.main = copy.deepcopy(main).double()
        self.source = copy.deepcopy(source).double()
        self.source.config._attn_implementation = "eager"
        self.source.config._experts_implementation = "eager"  # grouped_mm has no float64
        self.w = {k.removeprefix(MTP): v.double() for k, v in weights.items()}
        self.eps = main.config.rms_norm_eps

    @torch.no_grad()
    def outputs(self, next_tokens: list[int], hidden_states: torch.Tensor) -> torch.Tensor:
        """h' at positions 0..T-1 for pairs (hidden_states[p], next_tokens[p]); [T, hidden]."""
        w, n = self.w, len(next_tokens)
        emb = self.main.model.embed_tokens.weight[torch.tensor(next_tokens)]  # [T, hidden]
        fused = torch.cat(
            (_rms(emb, w["enorm.weight"], self.eps), _rms(hidden_states.double(), w["hnorm.weight"], self.eps)), dim=-1
        )
        x = (fused @ w["eh_proj.weight"].t())[None]  # [1, T, hidden]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        rotary = self.source.model.rotary_emb(x, positions)
        y = self.source.model.layers[0](x, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        return _rms(y[0], w["shared_head.norm.weight"], self.eps)

    @torch.no_grad()
    def probs(self, h: torch.Tensor) -> torch.Tensor:  # [vocab]
        return torch.softmax(self.main.lm_head.weight @ h, dim=-1)

    @torch.no_grad()
    def drafts(self, tokens: list[int], target_hidden: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        """k sequential drafts after `tokens`, given the target's h at positions 0..n-2."""
        next_tokens, hidden = list(tokens[1:]), target_hidden
        drafts, confidences = [], []
        for _ in range(k):
            out = self.outputs(next_tokens, hidden)[-1]
            p = self.probs(out)
            drafts.append(int(p.argmax()))
            confidences.append(float(p.max()))
            next_tokens.append(drafts[-1])
            hidden = torch.cat((hidden.double(), out[None]))
        return drafts, confidences


def _proposer(path: str, num_blocks: int) -> MtpProposer:
    checkpoint = open_checkpoint(path)
    target = build_model(checkpoint, "float32", "cpu", show_progress=False)
    mtp = build_mtp_model(checkpoint, "float32", "cpu")
    return MtpProposer(mtp, target, "cpu", "float32", num_blocks=num_blocks, block_size=4)


def test_mtp_drafts_and_confidences_match_a_float64_reference(random_checkpoint):
    """Catch-up over two queued chunks, three drafts (decode path with the MTP layer's own h),
    then a second round that accepts one draft: the draft entries are rolled back and the rows
    the target computed for its rejected draft are not fed."""
    path, main, source, weights = random_checkpoint
    oracle = Float64MTP(main, source, weights)
    proposer = _proposer(path, num_blocks=16)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (11,), generator=gen).tolist()
    hidden = torch.randn(10, main.config.hidden_size, generator=gen)  # the target's h at positions 0..9

    proposer.observe({"r": TargetHiddenStates(0, hidden[:6])})  # a prompt prefilled in two chunks
    proposer.observe({"r": TargetHiddenStates(6, hidden[6:])})
    proposal = proposer.propose({"r": tokens}, 3)["r"]
    expected_drafts, expected_conf = oracle.drafts(tokens, hidden, 3)
    assert proposal.token_ids == expected_drafts
    assert proposal.confidences == pytest.approx(expected_conf, abs=1e-5)
    assert proposer.cached_window("r") == (0, 10)

    # the round verified [tokens[-1], d1, d2, d3]: d1 accepted, then a correction token
    tokens += [expected_drafts[0], (expected_drafts[1] + 1) % VOCAB]
    round_rows = torch.randn(4, main.config.hidden_size, generator=gen)  # positions 10..13; 12, 13 rejected
    proposer.observe({"r": TargetHiddenStates(10, round_rows)})
    proposal = proposer.propose({"r": tokens}, 2)["r"]
    expected_drafts, expected_conf = oracle.drafts(tokens, torch.cat((hidden, round_rows[:2])), 2)
    assert proposal.token_ids == expected_drafts
    assert proposal.confidences == pytest.approx(expected_conf, abs=1e-5)
    assert proposer.cached_window("r") == (0, 12)

    proposer.propose({}, 2)  # the request finished: its blocks go back
    assert proposer.num_free_blocks == 16 - 1


def test_a_request_the_mtp_cache_cannot_hold_gets_no_drafts_and_keeps_its_hidden_states(random_checkpoint):
    proposer = _proposer(random_checkpoint[0], num_blocks=3)  # 2 usable blocks: 8 positions
    gen = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, VOCAB, (11,), generator=gen).tolist()
    proposer.observe({"r": TargetHiddenStates(0, torch.randn(10, 64, generator=gen))})
    assert proposer.propose({"r": tokens}, 3) == {}  # 10 positions + 2 drafts do not fit
    assert proposer.cached_window("r") == (0, 0)
    assert len(proposer.propose({"r": tokens[:7]}, 2)["r"].token_ids) == 2  # the queued rows are still there
    assert proposer.cached_window("r") == (0, 6)


# -- errors and flags --------------------------------------------------------------------------


def test_model_without_an_mtp_layer_is_a_config_error(tmp_path):
    """num_nextn_predict_layers absent or 0; declared but the tensors left out; another
    architecture."""
    path = str(tmp_path / "deepseek")
    build_one_layer_deepseek(0).save_pretrained(path)
    spec = SpecConfig(method="mtp")
    set_num_mtp_layers(path, None)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers is absent"):
        _llm(path, spec)
    set_num_mtp_layers(path, 0)
    with pytest.raises(ConfigError, match="no multi-token-prediction layer .*num_nextn_predict_layers is 0"):
        _llm(path, spec)
    set_num_mtp_layers(path, 1)
    with pytest.raises(ConfigError, match=r"no model\.layers\.1\.\* weights"):
        _llm(path, spec)
    llama = str(tmp_path / "llama")
    save_tiny_llama(llama, vocab_size=VOCAB, num_layers=1)
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        _llm(llama, spec)


def test_mtp_is_a_speculative_method_of_the_workers_and_the_cli():
    flags = ["--speculative-method", "mtp", "--num-speculative-tokens", "2"]
    args = build_parser().parse_args(["serve", "--role", "decode", *flags])
    assert worker_settings(args, env={}).engine.config.spec == SpecConfig(method="mtp", num_speculative_tokens=2)

"""The memory plan (`moemesh plan`) against independent oracles: the engine's own model classes
built on the meta device (the tensors it allocates), real checkpoints written by Hugging Face
transformers' `save_pretrained` (index names, shapes and total_size), the published parameter
totals, and hand arithmetic for the pod counts."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from moemesh.planning.memory_plan import (
    MemoryPlanError,
    check_expert_pods,
    load_model_metadata,
    parse_size,
    plan_mesh,
)
from tests.published_configs import DEEPSEEK_V3, QWEN3_30B_A3B

GIB = 2**30


def bf16(config: dict) -> dict:
    """The same model stored unquantized in bfloat16 (the parameter-count path)."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


def engine_model(config: dict) -> nn.Module:
    """The engine's model class for `config`, built on the meta device (no memory)."""
    from moemesh.engine.layers.transformer_config import TransformerConfig
    from moemesh.engine.models import get_model_class

    # rope_scaling dropped: the engine's RoPE refuses YaRN today (another change adds it). RoPE
    # holds buffers, not parameters, so the parameter shapes do not depend on it.
    hf = {k: v for k, v in config.items() if k not in ("rope_scaling", "quantization_config")}
    cfg = TransformerConfig.from_hf(hf)
    with torch.device("meta"):
        return get_model_class(cfg.architecture)(cfg)


def is_routed(name: str) -> bool:
    return name.endswith((".experts.w13", ".experts.w2"))


def engine_params(model: nn.Module) -> tuple[int, int]:
    """(routed-expert, other) parameter counts the engine allocates."""
    routed = sum(p.numel() for n, p in model.named_parameters() if is_routed(n))
    return routed, sum(p.numel() for p in model.parameters()) - routed


def engine_fp8_bytes(model: nn.Module, block: int = 128) -> tuple[int, int]:
    """(routed, other) bytes of DeepSeek-V3's FP8 release, from the engine's tensors: every linear
    inside a decoder layer in FP8 + a float32 scale per block (the engine's merged gate_up / w13
    split into HF's two projections on a block boundary, as 18432 and 2048 are multiples of 128),
    the correction bias in float32, everything else bfloat16."""
    routed = other = 0
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            in_layer = module_name.startswith("model.layers.")
            if (isinstance(module, nn.Linear) and name == "weight" and in_layer) or is_routed(f"{module_name}.{name}"):
                lead, (rows, cols) = math.prod(p.shape[:-2]), p.shape[-2:]
                size = p.numel() + 4 * lead * math.ceil(rows / block) * math.ceil(cols / block)
            elif name == "e_score_correction_bias":
                size = 4 * p.numel()
            else:
                size = 2 * p.numel()
            if is_routed(f"{module_name}.{name}"):
                routed += size
            else:
                other += size
    return routed, other


def engine_kv_bytes_per_token(model: nn.Module, itemsize: int = 2) -> int:
    return itemsize * sum(math.prod(s) for a in model.attention_layers() for s in a.kv_cache_shape(1, 1))


@pytest.fixture(scope="module")
def deepseek_engine():
    torch.set_num_threads(1)
    return engine_model(DEEPSEEK_V3)  # 61 layers on meta: about 1.5 s


@pytest.fixture(scope="module")
def deepseek_fp8_plan():
    return plan_mesh(DEEPSEEK_V3, None, parse_size("141GiB"), redundant_experts=32)


# -- byte and parameter counts vs the engine and the published totals ------------------------
def test_deepseek_v3_params_equal_what_the_engine_allocates(deepseek_engine):
    plan = plan_mesh(bf16(DEEPSEEK_V3), None, 141 * GIB)
    routed, other = engine_params(deepseek_engine)
    assert (plan.weights.routed_experts.params, plan.weights.non_expert.params) == (routed, other)
    assert plan.weights.total.bytes == 2 * plan.weights.total.params  # bfloat16
    assert abs(plan.weights.total.params / 671e9 - 1) < 0.001  # "671B" main model
    assert plan.kv_layout == "mla_latent"
    assert plan.kv_bytes_per_token == engine_kv_bytes_per_token(deepseek_engine) == (512 + 64) * 61 * 2


def test_deepseek_v3_mtp_layer_is_counted_apart_as_one_moe_layer_plus_its_own_embedding_and_head():
    plan = plan_mesh(bf16(DEEPSEEK_V3), None, 141 * GIB)
    h, v = 7168, 129280
    four, five = (engine_params(engine_model({**DEEPSEEK_V3, "num_hidden_layers": n})) for n in (4, 5))
    moe_layer = (five[0] - four[0], five[1] - four[1])  # layer 4 is MoE: the MTP block's twin
    mtp = plan.mtp_weights
    assert plan.num_mtp_layers == 1
    assert mtp.routed_experts.params == moe_layer[0]
    assert mtp.non_expert.params == moe_layer[1] + 2 * h * h + 3 * h + 2 * v * h  # eh_proj, 3 norms, embed + head
    unique = mtp.total.params - 2 * v * h
    assert abs(unique / 11.5e9 - 1) < 0.01  # README_WEIGHTS: "11.5B unique parameters"
    assert abs((plan.weights.total.params + mtp.total.params) / 685e9 - 1) < 0.005  # "685B" with MTP


def test_deepseek_v3_fp8_bytes_equal_the_engines_tensors_at_one_byte_plus_block_scales(
    deepseek_engine, deepseek_fp8_plan
):
    routed, other = engine_fp8_bytes(deepseek_engine)
    assert deepseek_fp8_plan.weights.routed_experts.bytes == routed
    assert deepseek_fp8_plan.weights.non_expert.bytes == other
    per_expert = 3 * 2048 * 7168 + 4 * 3 * (2048 // 128) * (7168 // 128)  # FP8 + scales, one layer
    assert deepseek_fp8_plan.slot_bytes == 58 * per_expert
    assert "fp8" in deepseek_fp8_plan.weight_format


def test_qwen3_30b_a3b_params_equal_what_the_engine_allocates():
    torch.set_num_threads(1)
    model = engine_model(QWEN3_30B_A3B)
    plan = plan_mesh(QWEN3_30B_A3B, None, 80 * 10**9)
    assert (plan.weights.routed_experts.params, plan.weights.non_expert.params) == engine_params(model)
    assert plan.weights.routed_experts.params == 48 * 128 * 3 * 2048 * 768
    assert abs(plan.weights.total.params / 30.5e9 - 1) < 0.005  # "30.5B total"
    assert plan.num_mtp_layers == 0 and plan.mtp_weights.total.params == 0
    assert plan.kv_bytes_per_token == engine_kv_bytes_per_token(model) == 2 * 4 * 128 * 48 * 2


# -- real (tiny) checkpoints written by transformers ------------------------------------------
def tiny_hf_configs():
    from transformers import DeepseekV3Config, LlamaConfig, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4)
    return {
        "qwen3_moe": Qwen3MoeConfig(
            **common,
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        ),  # only layer 1 is MoE
        "deepseek_v3": DeepseekV3Config(
            **common,
            num_hidden_layers=3,
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=8,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            n_shared_experts=1,
            moe_intermediate_size=16,
        ),
        "mixtral": MixtralConfig(
            **common, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2
        ),
        "llama_tied": LlamaConfig(**common, num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=True),
    }


def save_tiny_checkpoint(kind: str, folder) -> dict[str, tuple[int, ...]]:
    """Write a sharded bf16 checkpoint with transformers; return its tensors' shapes, then delete
    the weight files so that only config.json and the index remain."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hf_configs()[kind]).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="20KB")
    shapes = {}
    for file in os.listdir(folder):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(folder, file), framework="pt") as f:
                shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
            os.remove(os.path.join(folder, file))
    return shapes


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3", "mixtral", "llama_tied"])
def test_the_index_of_a_transformers_checkpoint_is_fully_accounted_for(kind, tmp_path):
    shapes = save_tiny_checkpoint(kind, tmp_path)
    config, index = load_model_metadata(str(tmp_path))
    assert index is not None and set(index["weight_map"]) == set(shapes)
    plan = plan_mesh(config, index, GIB)
    check = plan.index
    assert (check.num_unknown, check.num_missing, check.unaccounted_bytes) == (0, 0, 0)
    assert plan.weights.total.bytes == index["metadata"]["total_size"]
    routed = sum(math.prod(s) for n, s in shapes.items() if ".experts." in n and "shared_experts" not in n)
    assert plan.weights.routed_experts.params == routed
    assert plan.weights.routed_experts.bytes == 2 * routed
    assert plan_mesh(config, None, GIB).weights == plan.weights  # config alone implies the same tensors
    assert (plan.weights.routed_experts.params, plan.weights.non_expert.params) == engine_params(engine_model(config))
    if kind == "deepseek_v3":  # transformers' config says num_nextn_predict_layers 1 but stores no MTP layer
        assert config["num_nextn_predict_layers"] == 1 and plan.num_mtp_layers == 0
        assert plan.mtp_weights.total.params == 0 and any("the index stores none" in n for n in plan.notes)


def test_an_fp8_index_counts_scales_and_mtp_layers_exactly(tmp_path):
    """The tiny DeepSeek-V3 checkpoint re-described as DeepSeek's FP8 release would store it
    (block 16 so that ceil() matters), with one MTP layer appended."""
    shapes = save_tiny_checkpoint("deepseek_v3", tmp_path)
    config, _ = load_model_metadata(str(tmp_path))
    config.update(
        num_nextn_predict_layers=1, quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]}
    )
    h, v, last = 32, 64, config["num_hidden_layers"]
    mtp = {
        n.replace(f"model.layers.{last - 1}.", f"model.layers.{last}."): s
        for n, s in shapes.items()
        if n.startswith(f"model.layers.{last - 1}.")
    }
    mtp.update(
        {
            f"model.layers.{last}.{n}": s
            for n, s in [
                ("embed_tokens.weight", (v, h)),
                ("enorm.weight", (h,)),
                ("hnorm.weight", (h,)),
                ("eh_proj.weight", (h, 2 * h)),
                ("shared_head.norm.weight", (h,)),
                ("shared_head.head.weight", (v, h)),
            ]
        }
    )
    stored, size = {}, {"main": 0, "mtp": 0}
    for group, tensors in (("main", shapes), ("mtp", mtp)):
        for name, shape in tensors.items():
            quantized = (
                name.startswith("model.layers.")
                and len(shape) == 2
                and not name.endswith(
                    (".gate.weight", "embed_tokens.weight", "eh_proj.weight", "shared_head.head.weight")
                )
            )
            stored[name] = "x.safetensors"
            if quantized:
                stored[name + "_scale_inv"] = "x.safetensors"
                size[group] += math.prod(shape) + 4 * math.ceil(shape[0] / 16) * math.ceil(shape[1] / 16)
            else:
                size[group] += math.prod(shape) * (4 if name.endswith("e_score_correction_bias") else 2)
    index = {"metadata": {"total_size": size["main"] + size["mtp"]}, "weight_map": stored}
    plan = plan_mesh(config, index, GIB)
    assert (plan.weights.total.bytes, plan.mtp_weights.total.bytes) == (size["main"], size["mtp"])
    assert (plan.index.num_unknown, plan.index.num_missing, plan.index.unaccounted_bytes) == (0, 0, 0)
    without_index = plan_mesh(config, None, GIB)
    assert (without_index.weights, without_index.mtp_weights) == (plan.weights, plan.mtp_weights)


def test_index_names_the_config_does_not_explain_are_reported_not_guessed():
    index = {"metadata": {"total_size": 10**9}, "weight_map": {"model.embed_tokens.weight": "a", "vision.w": "a"}}
    plan = plan_mesh(QWEN3_30B_A3B, index, 80 * GIB)
    assert plan.index.num_unknown == 1 and plan.index.unknown_names == ("vision.w",)
    assert plan.index.num_missing > 0 and plan.weights.total.params == 151936 * 2048
    assert any("does not explain" in n for n in plan.notes) and any("lacks" in n for n in plan.notes)


# -- pod counts ----------------------------------------------------------------------------
def test_deepseek_v3_fp8_on_141gib_needs_8_expert_pods_for_one_copy_and_6_with_32_redundant(deepseek_fp8_plan):
    plan = deepseek_fp8_plan
    usable = int(141 * GIB * 0.9)
    assert plan.usable_bytes_per_pod == usable
    # a slot is 58 x 44,050,944 B = 2.555e9 B; usable 136.3e9 B holds 53 slots. 256 slots: divisors 4 (64) no,
    # 8 (32) yes. 288 slots: 4 (72) no, 5 does not divide, 6 (48) yes; twice: 12 (24) for a rebalance.
    assert (plan.one_copy.min_workers, plan.one_copy.slots_per_worker) == (8, 32)
    assert (plan.with_redundancy.num_slots, plan.with_redundancy.min_workers) == (288, 6)
    assert plan.with_redundancy.min_workers_for_rebalance == 12
    assert plan.attention_pod_kv_tokens == (usable - plan.weights.non_expert.bytes) // (576 * 61 * 2)
    assert plan.aggregated_pod_kv_tokens == 0  # 627 GiB of weights never fit one pod


def test_check_expert_pods_names_how_many_pods_are_needed(deepseek_fp8_plan):
    assert check_expert_pods(deepseek_fp8_plan, 6) is None
    assert check_expert_pods(deepseek_fp8_plan, 9) is None  # 32 slots each
    too_few = check_expert_pods(deepseek_fp8_plan, 4)
    assert "4 expert pods would hold 72 slots" in too_few and "at least 6 expert pods" in too_few
    uneven = check_expert_pods(deepseek_fp8_plan, 5)
    assert "do not divide evenly over 5" in uneven and "at least 6 expert pods" in uneven
    assert "at least 6 expert pods" in check_expert_pods(deepseek_fp8_plan, 0)
    planned = plan_mesh(DEEPSEEK_V3, None, 141 * GIB, expert_pods=4, redundant_experts=32)
    assert planned.expert_pods_problem == too_few


def test_a_pod_smaller_than_one_slot_fits_no_pod_count():
    plan = plan_mesh(DEEPSEEK_V3, None, 2 * GIB)
    assert plan.one_copy.min_workers is None
    assert "no expert pod count fits" in check_expert_pods(plan, 256)


def test_qwen3_fits_one_pod_and_a_dense_model_needs_no_expert_pods():
    assert check_expert_pods(plan_mesh(QWEN3_30B_A3B, None, 141 * GIB), 0) is None
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
    }
    plan = plan_mesh(llama, None, GIB, expert_pods=0)
    assert plan.one_copy is None and plan.expert_pods_problem is None
    assert plan.weights.total.params == 100 * 64 * 2 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64


# -- sizes --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, size",
    [
        ("141GiB", 141 * 2**30),
        ("80GB", 80 * 10**9),
        ("80Gi", 80 * 2**30),
        ("80G", 80 * 10**9),
        ("1.5TiB", 3 * 2**39),
        (" 2 MiB ", 2 * 2**20),
        ("123", 123),
        (4096, 4096),
        ("512kb", 512_000),
        ("1tb", 10**12),
    ],
)
def test_sizes_read_binary_and_si_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "10XB", "-5GB", "0", "0GiB", "1e9", "GiB", "1.2.3GB"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(MemoryPlanError):
        parse_size(text)


# -- the command line ------------------------------------------------------------------------
def moemesh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moemesh.cli", *args], capture_output=True, text=True, timeout=60)


def test_cli_plans_qwen3_from_a_folder_holding_only_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    done = moemesh("plan", "--model", str(tmp_path), "--gpu-memory", "80GB", "--kv-tokens", "100000", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    non_expert = 48 * (2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128 + 128 * 2048 + 2 * 2048) + 2 * 151936 * 2048 + 2048
    assert plan["weights"]["non_expert"] == {"params": non_expert, "bytes": 2 * non_expert}
    assert plan["weights"]["routed_experts"]["params"] == 48 * 128 * 3 * 2048 * 768
    assert plan["kv_bytes_per_token"] == 98304 and plan["usable_bytes_per_pod"] == 72 * 10**9
    assert plan["attention_pod_kv_tokens"] == (72 * 10**9 - 2 * non_expert) // 98304
    assert plan["one_copy"]["min_workers"] == 1 and plan["kv_tokens_fit"] is True and plan["index"] is None
    text = moemesh("plan", "--model", str(tmp_path / "config.json"), "--gpu-memory", "80GB")
    assert text.returncode == 0 and "routed_experts" in text.stdout and "KV cache (K and V" in text.stdout


def test_cli_reads_the_index_next_to_config_json(tmp_path):
    save_tiny_checkpoint("qwen3_moe", tmp_path)
    total_size = json.loads((tmp_path / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    done = moemesh("plan", "--model", str(tmp_path), "--gpu-memory", "1GiB", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["index"]["total_size"] == total_size == plan["weights"]["total"]["bytes"]
    assert plan["index"]["unaccounted_bytes"] == 0


def test_cli_exits_1_when_the_expert_pods_are_too_few(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    done = moemesh(
        "plan", "--model", str(tmp_path), "--gpu-memory", "141GiB", "--redundant-experts", "32", "--expert-pods", "4"
    )
    assert done.returncode == 1
    assert "at least 6 expert pods" in done.stdout and "MTP layers (1, stored, not loaded)" in done.stdout


def _write(folder, name: str, content) -> str:
    path = folder / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(folder)


BAD_INPUTS = {
    "no such path": lambda d: (str(d / "nope"), []),
    "config not JSON": lambda d: (_write(d, "config.json", "{not json"), []),
    "config a list": lambda d: (_write(d, "config.json", [1]), []),
    "unsupported architecture": lambda d: (_write(d, "config.json", {**QWEN3_30B_A3B, "architectures": ["Gpt2"]}), []),
    "missing field": lambda d: (
        _write(d, "config.json", {k: v for k, v in QWEN3_30B_A3B.items() if k != "hidden_size"}),
        [],
    ),
    "unsupported quantization": lambda d: (
        _write(d, "config.json", {**QWEN3_30B_A3B, "quantization_config": {"quant_method": "awq"}}),
        [],
    ),
    "bad index": lambda d: (
        _write(d, "config.json", QWEN3_30B_A3B) and _write(d, "model.safetensors.index.json", {"weight_map": []}),
        [],
    ),
    "bad gpu memory": lambda d: (_write(d, "config.json", QWEN3_30B_A3B), ["--gpu-memory", "lots"]),
    "negative kv tokens": lambda d: (_write(d, "config.json", QWEN3_30B_A3B), ["--kv-tokens", "-1"]),
    "reserve everything": lambda d: (_write(d, "config.json", QWEN3_30B_A3B), ["--reserve-fraction", "1"]),
    "redundant experts on a dense model": lambda d: (
        _write(d, "config.json", {**QWEN3_30B_A3B, "num_experts": 0}),
        ["--redundant-experts", "2"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_prints_the_reason_and_exits_2(case, tmp_path, capsys):
    from moemesh.cli import main

    model, extra = BAD_INPUTS[case](tmp_path)
    assert main(["plan", "--model", model, "--gpu-memory", "80GB", *extra]) == 2  # a later --gpu-memory wins
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("moemesh: error: ")


def test_bad_input_exits_2_in_a_subprocess_too(tmp_path):
    done = moemesh("plan", "--model", str(tmp_path / "missing"), "--gpu-memory", "80GB")
    assert done.returncode == 2 and "neither a model directory nor a config.json file" in done.stderr


def test_the_plan_leaves_the_callers_config_untouched():
    config = copy.deepcopy(DEEPSEEK_V3)
    plan_mesh(config, None, 141 * GIB)
    assert config == DEEPSEEK_V3

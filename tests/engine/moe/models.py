"""Tiny random MoE checkpoints built with transformers' own config and model classes, saved with
`save_pretrained` (what moemesh loads), plus a plain greedy oracle on the HF model."""

from __future__ import annotations

import torch

NUM_PROMPTS, MAX_NEW = 8, 24
VOCAB = 128


def _common(**kw) -> dict:
    # initializer_range 0.1 (not 0.02): every sublayer, and the routing, visibly moves the logits
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=256,
        initializer_range=0.1,
        eos_token_id=None,
        bos_token_id=None,
        tie_word_embeddings=False,
        **kw,
    )


def build_qwen3_moe(**overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # 4 layers: layer 1 is dense (mlp_only_layers); top-4 of 16 experts, renormalized.
    config = Qwen3MoeConfig(
        **_common(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
        | overrides
    )
    return Qwen3MoeForCausalLM(config)


def build_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        **_common(
            intermediate_size=48,
            num_hidden_layers=2,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
        )
    )
    return MixtralForCausalLM(config)


def build_deepseek_v3(q_lora_rank: int | None = 48, **overrides):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # 3 layers: layer 0 dense, then two MoE layers; 16 experts in 4 groups, 2 groups kept, top-4.
    config = DeepseekV3Config(
        **_common(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_key_value_heads=4,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            kv_lora_rank=32,
            q_lora_rank=q_lora_rank,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
        )
        | overrides
    )
    model = DeepseekV3ForCausalLM(config)
    set_correction_biases(model)
    return model


def set_correction_biases(model) -> None:
    """Nonzero selection biases, negative ones included. MoE layer 0: mild noise around 0. MoE
    layer 1: in every group one expert near 0 and three near -1, so the kept groups hold fewer
    than top_k experts with a positive biased score; there masking dropped groups with 0.0 (the
    old HF gate) would pick dropped-group experts, masking with -inf (DeepSeek's reference) never
    does."""
    gen = torch.Generator().manual_seed(7)
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    num_experts = gates[0].e_score_correction_bias.shape[0]
    with torch.no_grad():
        gates[0].e_score_correction_bias.copy_(0.3 * torch.randn(num_experts, generator=gen))
        strongly_negative = (torch.arange(num_experts) % 4 != 0).float()
        gates[1].e_score_correction_bias.copy_(0.05 * torch.randn(num_experts, generator=gen) - strongly_negative)


BUILDERS = {"qwen3_moe": build_qwen3_moe, "mixtral": build_mixtral, "deepseek_v3": build_deepseek_v3}


def save_tiny(builder, path: str, seed: int = 0):
    torch.manual_seed(seed)
    model = builder().eval()
    model.save_pretrained(path)
    return model


def make_prompts(seed: int = 1) -> list[list[int]]:
    """8 prompts of mixed lengths; prompts 5 and 6 share their first 8 tokens with prompt 4."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 7, 12, 5, 17, 9, 21, 14]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    prompts[5][:8] = prompts[4][:8]
    prompts[6][:8] = prompts[4][:8]
    return prompts


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    """Greedy decoding by full recomputation each step: no cache, no padding."""
    ids = list(prompt)
    for _ in range(max_new):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]

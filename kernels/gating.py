"""MoE gating: router logits -> (topk_weights float32 [num_tokens, top_k], topk_ids int64 [num_tokens, top_k]).

Two families:
- `topk_softmax` (Mixtral, Qwen3-MoE): softmax in float32 over all experts, the top_k largest,
  optionally renormalized to sum 1 (`norm_topk_prob`).
- `grouped_topk` (DeepSeek-V2/V3): experts split into `num_expert_group` equal groups; only the
  best `topk_group` groups may be chosen. See `grouped_topk_ref` for the exact recipe.

Ties are broken deterministically: among equal scores the lower expert (or group) index wins,
in the references (a stable descending sort; `torch.topk` makes no promise about ties) and in the
kernels (an explicit "lowest index among the maxima" selection). ids are in descending score order.
"""

import torch

from moemesh.kernels._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_dtype,
    check_inner_contiguous,
    check_launchable,
    launch,
    next_pow2,
    scratch,
    tl,
    triton,
)


def _topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:  # [num_tokens, k] int64
    """Indices of the k largest scores per row, largest first, ties to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def topk_softmax_ref(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k] float32, [num_tokens, top_k] int64
    """Experts are selected on the float32 logits: softmax is monotonic, so these are the experts
    with the largest probabilities, without ties that only come from rounding exp()."""
    _check_topk_args(router_logits, top_k)
    logits = router_logits.float()  # [num_tokens, num_experts]
    ids = _topk_ids(logits, top_k)
    weights = torch.softmax(logits, dim=-1).gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk_ref(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    e_score_correction_bias: torch.Tensor | None,  # [num_experts] or None
    renormalize: bool,
    routed_scaling_factor: float,
    scoring_func: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k] float32, [num_tokens, top_k] int64
    """DeepSeek-V3's reference gate (inference/model.py `Gate.forward`):

    scores = sigmoid(logits) (or softmax); biased = scores + e_score_correction_bias, used for
    selection only; group score = sum of the top-2 biased scores of each group (without a bias:
    the max score of each group, as DeepSeek-V2's reference does); keep the best topk_group
    groups and mask the others with -inf; top_k experts on the masked biased scores; weights =
    the unbiased scores at those experts, divided by their sum if `renormalize`, times
    `routed_scaling_factor`.

    Masking uses -inf like DeepSeek's reference. Hugging Face's DeepseekV3 gate masks with 0.0
    instead; the two differ when biased scores are negative (a strongly negative bias): with
    0.0 an expert of a dropped group can outrank every expert of the kept groups.
    """
    _check_grouped_args(router_logits, top_k, num_expert_group, topk_group, e_score_correction_bias, scoring_func)
    num_tokens, num_experts = router_logits.shape
    logits = router_logits.float()  # [num_tokens, num_experts]
    scores = torch.sigmoid(logits) if scoring_func == "sigmoid" else torch.softmax(logits, dim=-1)
    biased = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    grouped = biased.view(num_tokens, num_expert_group, num_experts // num_expert_group)
    if e_score_correction_bias is None:
        group_scores = grouped.amax(dim=-1)  # [num_tokens, num_expert_group]
    else:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    kept_groups = _topk_ids(group_scores, topk_group)  # [num_tokens, topk_group]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    masked = grouped.masked_fill(~kept[:, :, None], float("-inf")).flatten(1)  # [num_tokens, num_experts]
    ids = _topk_ids(masked, top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routed_scaling_factor, ids


def _check_topk_args(router_logits: torch.Tensor, top_k: int) -> None:
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [num_tokens, num_experts], got {list(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be in [1, num_experts={router_logits.shape[1]}], got {top_k}")


def _check_grouped_args(router_logits, top_k, num_expert_group, topk_group, bias, scoring_func) -> None:
    _check_topk_args(router_logits, top_k)
    num_experts = router_logits.shape[1]
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(f"num_expert_group {num_expert_group} must divide num_experts {num_experts}")
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group must be in [1, num_expert_group={num_expert_group}], got {topk_group}")
    if top_k > topk_group * (num_experts // num_expert_group):
        raise ValueError(f"top_k {top_k} exceeds the {topk_group} kept groups' experts")
    if bias is not None and tuple(bias.shape) != (num_experts,):
        raise ValueError(f"e_score_correction_bias must be [num_experts={num_experts}], got {list(bias.shape)}")
    if scoring_func not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring_func must be 'sigmoid' or 'softmax', got {scoring_func!r}")


# ---------------------------------------------------------------------------------------------
# Triton: one program per token; the row of experts is one tile; top-k by k rounds of "largest
# value, lowest index among equals".

if HAS_TRITON:

    @triton.jit
    def _topk_softmax_kernel(
        logits_ptr,  # [num_tokens, num_experts], dense rows
        weights_ptr,  # [num_tokens, top_k] float32
        ids_ptr,  # [num_tokens, top_k] int64
        logits_row_stride,
        NUM_EXPERTS: tl.constexpr,
        TOP_K: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        experts = tl.arange(0, BLOCK_E)
        valid = experts < NUM_EXPERTS
        x = tl.load(logits_ptr + token * logits_row_stride + experts, mask=valid, other=float("-inf")).to(tl.float32)
        e = tl.where(valid, tl.exp(x - tl.max(x, 0)), 0.0)
        probs = e / tl.sum(e, 0)
        slots = tl.arange(0, BLOCK_K)
        top_ids = tl.zeros([BLOCK_K], tl.int32)
        top_weights = tl.zeros([BLOCK_K], tl.float32)
        free = valid
        for i in tl.static_range(TOP_K):
            best = tl.max(tl.where(free, x, float("-inf")), 0)
            pick = tl.min(tl.where(free & (x == best), experts, BLOCK_E), 0)
            hit = experts == pick
            free = free & (experts != pick)
            top_ids = tl.where(slots == i, pick, top_ids)
            top_weights = tl.where(slots == i, tl.sum(tl.where(hit, probs, 0.0), 0), top_weights)
        if RENORMALIZE:
            top_weights = top_weights / tl.sum(top_weights, 0)
        out_mask = slots < TOP_K
        tl.store(weights_ptr + token * TOP_K + slots, top_weights, mask=out_mask)
        tl.store(ids_ptr + token * TOP_K + slots, top_ids.to(tl.int64), mask=out_mask)

    @triton.jit
    def _grouped_topk_kernel(
        logits_ptr,  # [num_tokens, num_experts], dense rows
        bias_ptr,  # [num_experts]; read only when HAS_BIAS
        weights_ptr,  # [num_tokens, top_k] float32
        ids_ptr,  # [num_tokens, top_k] int64
        logits_row_stride,
        routed_scaling_factor,
        NUM_GROUPS: tl.constexpr,
        EXPERTS_PER_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        SIGMOID: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_EG: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        groups = tl.arange(0, BLOCK_G)
        members = tl.arange(0, BLOCK_EG)
        group_valid = groups < NUM_GROUPS
        valid = group_valid[:, None] & (members < EXPERTS_PER_GROUP)[None, :]  # [BLOCK_G, BLOCK_EG]
        experts = groups[:, None] * EXPERTS_PER_GROUP + members[None, :]
        x = tl.load(logits_ptr + token * logits_row_stride + experts, mask=valid, other=0.0).to(tl.float32)
        if SIGMOID:
            scores = 1.0 / (1.0 + tl.exp(-x))
        else:
            e = tl.where(valid, tl.exp(x - tl.max(tl.max(tl.where(valid, x, float("-inf")), 1), 0)), 0.0)
            scores = e / tl.sum(tl.sum(e, 1), 0)
        biased = scores
        if HAS_BIAS:
            biased = scores + tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
        biased = tl.where(valid, biased, float("-inf"))
        top1 = tl.max(biased, 1)  # [BLOCK_G]
        if HAS_BIAS and EXPERTS_PER_GROUP >= 2:  # sum of the group's two best biased scores
            first = tl.min(tl.where(biased == top1[:, None], members[None, :], BLOCK_EG), 1)
            group_scores = top1 + tl.max(tl.where(members[None, :] == first[:, None], float("-inf"), biased), 1)
        else:
            group_scores = top1
        kept = groups < 0  # no group kept yet
        for _ in tl.static_range(TOPK_GROUP):
            free = group_valid & (kept == 0)
            best = tl.max(tl.where(free, group_scores, float("-inf")), 0)
            pick = tl.min(tl.where(free & (group_scores == best), groups, BLOCK_G), 0)
            kept = kept | (groups == pick)
        free = valid & kept[:, None]  # experts of kept groups, not chosen yet
        slots = tl.arange(0, BLOCK_K)
        top_ids = tl.zeros([BLOCK_K], tl.int32)
        top_weights = tl.zeros([BLOCK_K], tl.float32)
        for i in tl.static_range(TOP_K):
            best = tl.max(tl.max(tl.where(free, biased, float("-inf")), 1), 0)
            pick = tl.min(tl.min(tl.where(free & (biased == best), experts, NUM_GROUPS * EXPERTS_PER_GROUP), 1), 0)
            hit = experts == pick
            free = free & (experts != pick)
            top_ids = tl.where(slots == i, pick, top_ids)
            top_weights = tl.where(slots == i, tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0), top_weights)
        if RENORMALIZE:
            top_weights = top_weights / tl.sum(top_weights, 0)
        out_mask = slots < TOP_K
        tl.store(weights_ptr + token * TOP_K + slots, top_weights * routed_scaling_factor, mask=out_mask)
        tl.store(ids_ptr + token * TOP_K + slots, top_ids.to(tl.int64), mask=out_mask)


def _check_logits(name: str, router_logits: torch.Tensor, *others: torch.Tensor) -> None:
    check_launchable(name, router_logits, *others)
    check_dtype(name, "router_logits", router_logits, FLOAT_DTYPES)
    check_inner_contiguous(name, "router_logits", router_logits, 1)


def _outputs(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, device = router_logits.shape[0], router_logits.device
    weights = scratch((num_tokens, top_k), torch.float32, device)  # [num_tokens, top_k]
    ids = scratch((num_tokens, top_k), torch.int64, device)  # [num_tokens, top_k]
    return weights, ids


def topk_softmax_triton(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k] float32, [num_tokens, top_k] int64
    name = "topk_softmax_triton"
    try:
        _check_topk_args(router_logits, top_k)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    _check_logits(name, router_logits)
    num_tokens, num_experts = router_logits.shape
    weights, ids = _outputs(router_logits, top_k)
    if num_tokens > 0:
        launch(
            _topk_softmax_kernel,
            (num_tokens,),
            router_logits,
            weights,
            ids,
            router_logits.stride(0),
            NUM_EXPERTS=num_experts,
            TOP_K=top_k,
            RENORMALIZE=bool(renormalize),
            BLOCK_E=next_pow2(num_experts),
            BLOCK_K=next_pow2(top_k),
        )
    return weights, ids


def grouped_topk_triton(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    e_score_correction_bias: torch.Tensor | None,  # [num_experts] or None
    renormalize: bool,
    routed_scaling_factor: float,
    scoring_func: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k] float32, [num_tokens, top_k] int64
    name = "grouped_topk_triton"
    bias = e_score_correction_bias
    try:
        _check_grouped_args(router_logits, top_k, num_expert_group, topk_group, bias, scoring_func)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    _check_logits(name, router_logits, *(() if bias is None else (bias,)))
    if bias is not None:
        check_dtype(name, "e_score_correction_bias", bias, FLOAT_DTYPES)
    num_tokens, num_experts = router_logits.shape
    experts_per_group = num_experts // num_expert_group
    weights, ids = _outputs(router_logits, top_k)
    if num_tokens > 0:
        launch(
            _grouped_topk_kernel,
            (num_tokens,),
            router_logits,
            router_logits if bias is None else bias.contiguous(),
            weights,
            ids,
            router_logits.stride(0),
            float(routed_scaling_factor),
            NUM_GROUPS=num_expert_group,
            EXPERTS_PER_GROUP=experts_per_group,
            TOPK_GROUP=topk_group,
            TOP_K=top_k,
            HAS_BIAS=bias is not None,
            RENORMALIZE=bool(renormalize),
            SIGMOID=scoring_func == "sigmoid",
            BLOCK_G=next_pow2(num_expert_group),
            BLOCK_EG=next_pow2(experts_per_group),
            BLOCK_K=next_pow2(top_k),
        )
    return weights, ids

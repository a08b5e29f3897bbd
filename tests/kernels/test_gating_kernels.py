import math

import pytest
import torch

from moemesh.kernels.gating import grouped_topk_ref, grouped_topk_triton, topk_softmax_ref, topk_softmax_triton

NUM_TOKENS, NUM_EXPERTS = 6, 16


def _select(values: list[float], k: int) -> list[int]:
    """The k largest, largest first, ties to the lower index."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def _py_topk_softmax(row: list[float], top_k: int, renormalize: bool):
    top = max(row)
    exps = [math.exp(v - top) for v in row]
    probs = [e / sum(exps) for e in exps]
    ids = _select(probs, top_k)
    weights = [probs[i] for i in ids]
    if renormalize:
        weights = [w / sum(weights) for w in weights]
    return weights, ids


def _py_grouped_topk(row, top_k, num_groups, topk_group, bias, renormalize, scaling, scoring_func, mask=-math.inf):
    """DeepSeek-V3's gate in plain python; mask=0.0 gives Hugging Face's variant."""
    if scoring_func == "sigmoid":
        scores = [1 / (1 + math.exp(-v)) for v in row]
    else:
        exps = [math.exp(v - max(row)) for v in row]
        scores = [e / sum(exps) for e in exps]
    biased = [s + (bias[i] if bias is not None else 0.0) for i, s in enumerate(scores)]
    size = len(row) // num_groups
    groups = [biased[g * size : (g + 1) * size] for g in range(num_groups)]
    if bias is None:
        group_scores = [max(g) for g in groups]
    else:
        group_scores = [sum(sorted(g, reverse=True)[:2]) for g in groups]
    kept = _select(group_scores, topk_group)
    masked = [b if i // size in kept else mask for i, b in enumerate(biased)]
    ids = _select(masked, top_k)
    weights = [scores[i] for i in ids]
    if renormalize:
        weights = [w / sum(weights) for w in weights]
    return [w * scaling for w in weights], ids


def _check(result, expected_rows):
    weights, ids = result
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert ids.tolist() == [r[1] for r in expected_rows]
    expected = torch.tensor([r[0] for r in expected_rows], dtype=torch.float64)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-5, atol=1e-6)


def _logits_with_ties(dtype):
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS)
    logits[0, [2, 5, 11]] = 4.0  # a three-way tie at the top
    logits[1] = 0.5  # every expert ties
    logits[2] = torch.linspace(-2.0, 1.0, NUM_EXPERTS)
    logits[2, 9] = 3.0
    logits[2, [12, 3, 1]] = 2.0  # the second place ties three ways
    return logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_matches_plain_python_including_ties(dtype, renormalize):
    logits = _logits_with_ties(dtype)
    expected = [_py_topk_softmax(row, 3, renormalize) for row in logits.double().tolist()]
    assert expected[0][1] == [2, 5, 11] and expected[1][1] == [0, 1, 2] and expected[2][1] == [9, 1, 3]
    _check(topk_softmax_triton(logits, 3, renormalize), expected)
    _check(topk_softmax_ref(logits, 3, renormalize), expected)


def _grouped_logits_with_ties():
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS)  # 4 groups of 4 experts
    logits[0, 4:8] = logits[0, 12:16] = torch.tensor([1.5, 2.0, 2.0, -1.0])  # groups 1 and 3 tie
    logits[0, 0:4] = torch.tensor([3.0, 3.0, -2.0, -2.0])  # group 0 best, its two experts tie
    logits[0, 8:12] = -3.0
    return logits


# (bias, scoring_func, renormalize, routed_scaling_factor)
GROUPED_CASES = [
    (True, "sigmoid", True, 2.5),
    (False, "sigmoid", True, 1.0),
    (True, "softmax", False, 1.0),
    (False, "softmax", False, 16.0),
]


@pytest.mark.parametrize("with_bias,scoring_func,renormalize,scaling", GROUPED_CASES)
def test_grouped_topk_matches_plain_python_including_ties(with_bias, scoring_func, renormalize, scaling):
    logits = _grouped_logits_with_ties()
    bias = torch.randn(NUM_EXPERTS) * 0.3 if with_bias else None
    if bias is not None:
        bias[4:8] = bias[12:16]  # keep groups 1 and 3 tied after the bias
    bias_list = None if bias is None else bias.double().tolist()
    args = (3, 4, 2, bias, renormalize, scaling, scoring_func)
    expected = [
        _py_grouped_topk(row, 3, 4, 2, bias_list, renormalize, scaling, scoring_func)
        for row in logits.double().tolist()
    ]
    _check(grouped_topk_triton(logits, *args), expected)
    _check(grouped_topk_ref(logits, *args), expected)


def test_grouped_topk_keeps_the_lower_group_and_expert_on_exact_ties():
    logits = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])  # groups 1 and 3 tie, as do their experts
    for fn in (grouped_topk_triton, grouped_topk_ref):
        _, ids = fn(logits, 2, 4, 1, torch.zeros(8), True, 1.0)
        assert ids.tolist() == [[2, 3]]  # group 1 beats group 3, expert 2 beats expert 3


def test_negative_bias_selects_only_kept_groups_where_zero_masking_would_not():
    """Biased scores all < 0: masking dropped groups with 0.0 (HF) would pick from them."""
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS)
    bias = -1.0 - torch.rand(NUM_EXPERTS)  # sigmoid <= 1, so every biased score is negative
    bias_list = bias.double().tolist()
    rows = logits.double().tolist()
    expected = [_py_grouped_topk(row, 4, 4, 2, bias_list, True, 1.0, "sigmoid") for row in rows]
    zero_masked = [_py_grouped_topk(row, 4, 4, 2, bias_list, True, 1.0, "sigmoid", mask=0.0) for row in rows]
    for (_, ids), (_, hf_ids) in zip(expected, zero_masked):
        assert ids != hf_ids
        assert len({i // 4 for i in ids}) <= 2  # only the two kept groups
    for fn in (grouped_topk_triton, grouped_topk_ref):
        weights, ids = fn(logits, 4, 4, 2, bias, True, 1.0)
        assert ids.tolist() == [e[1] for e in expected]
        assert weights.sum(-1).sub(1).abs().max() < 1e-6


def test_gating_rejects_inconsistent_group_arguments():
    logits = torch.randn(2, NUM_EXPERTS)
    for fn in (grouped_topk_triton, grouped_topk_ref):
        with pytest.raises(ValueError, match="must divide"):
            fn(logits, 2, 3, 1, None, True, 1.0)
        with pytest.raises(ValueError, match="kept groups"):
            fn(logits, 5, 4, 1, None, True, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        topk_softmax_triton(logits, NUM_EXPERTS + 1, True)

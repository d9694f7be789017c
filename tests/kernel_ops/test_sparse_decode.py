"""Sparse-decode Triton kernels against their PyTorch references (kernels/sparse_decode/reference.py).

CPU: Triton interpreter, float32. Tolerance FP32_TOL = 1e-5 relative RMS: kernel and reference do the same fp32 math
with a different summation order (online softmax in exp2, split merge); the observed error is ~1e-7, while a wrong
head, a wrong block, an unmasked padding position or a dropped split gives errors of order 1e-1.
GPU (marked ``gpu``): bfloat16 inputs; BF16_TOL = 2e-2 because the kernel rounds the softmax weights to bf16 before
the P.V product (as flash attention does) while the reference stays in fp32.
Every output buffer the kernels allocate is NaN-poisoned, so unwritten memory fails the comparison.
"""
from __future__ import annotations

import pytest
import torch

from _testing import nan_poisoned_allocations, rel_rms
from retrofit.kernels.sparse_decode import (
    block_topk,
    block_topk_ref,
    cluster_scores,
    cluster_scores_ref,
    cluster_take,
    cluster_take_ref,
    cluster_token_mask,
    cluster_token_mask_ref,
    fixed_count,
    fixed_positions,
    mask_positions,
    mask_positions_ref,
    pool_newest_block,
    pool_newest_block_ref,
    quest_page_scores,
    quest_page_scores_ref,
    quest_page_update,
    quest_page_update_ref,
    seer_gate_key_update,
    seer_gate_key_update_ref,
    sparse_decode_attention,
    sparse_decode_attention_ref,
    topk_indices,
    topk_indices_ref,
)

FP32_TOL = 1e-5  # see module docstring
BF16_TOL = 2e-2  # see module docstring

# (B, Hq, Hkv, D, N, block_size, S): N is the context length (1, 63, 75 awkward); Hq=9/Hkv=3 is SmolLM2's GQA
ATTENTION_CASES = {
    "smollm2-tokens-N75": (2, 9, 3, 64, 75, 1, 40),
    "single-token-S1-N1": (1, 9, 3, 64, 1, 1, 1),
    "pages16-N75-partial-last-page": (2, 9, 3, 64, 75, 16, 3),
    "pages16-N63": (3, 4, 2, 64, 63, 16, 4),
    "mha-D48-N63": (1, 3, 3, 48, 63, 1, 63),
    "blocks64-N75": (2, 8, 1, 32, 75, 64, 2),
}


def _attention_inputs(B, Hq, Hkv, D, N, block_size, S, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=gen)
    k = torch.randn(B, Hkv, N, D, generator=gen)
    v = torch.randn(B, Hkv, N, D, generator=gen)
    blocks = -(-N // block_size)
    S = min(S, blocks)
    indices = torch.stack([torch.stack([torch.randperm(blocks, generator=gen)[:S] for _ in range(Hkv)])
                           for _ in range(B)]).to(torch.int32)
    counts = torch.randint(0, S + 1, (B, Hkv), generator=gen, dtype=torch.int32)
    counts[0, 0] = S  # at least one full row
    kv_start = torch.randint(0, max(N // 4, 1), (B,), generator=gen, dtype=torch.int32)
    kv_start[0] = 0
    kv_end = torch.full((B,), N, dtype=torch.int32)
    kv_end[-1] = max(int(kv_start[-1]) + 1, N - 2)  # ragged valid ends
    as_device = lambda t: t.to(device)  # noqa: E731
    return (as_device(q.to(dtype)), as_device(k.to(dtype)), as_device(v.to(dtype)), as_device(indices),
            as_device(counts), as_device(kv_start), as_device(kv_end))


@pytest.mark.parametrize("splits", [1, 3], ids=["splits1", "splits3"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES), ids=list(ATTENTION_CASES))
def test_sparse_decode_attention_matches_reference_fp32(case, splits):
    B, Hq, Hkv, D, N, block_size, S = ATTENTION_CASES[case]
    q, k, v, indices, counts, kv_start, kv_end = _attention_inputs(B, Hq, Hkv, D, N, block_size, S)
    with nan_poisoned_allocations():
        out = sparse_decode_attention(q, k, v, indices, counts, kv_start, kv_end, block_size, num_splits=splits)
    expected = sparse_decode_attention_ref(q, k, v, indices, counts, kv_start, kv_end, block_size)
    assert not out.isnan().any()
    assert rel_rms(out, expected) < FP32_TOL


@pytest.mark.parametrize("softcap", [5.0, 50.0], ids=["cap5", "cap50"])
@pytest.mark.parametrize("case", ["smollm2-tokens-N75", "pages16-N63", "mha-D48-N63"])
def test_softcapped_sparse_decode_attention_matches_reference_fp32(case, softcap):
    """Logit softcapping (Gemma 2) in the kernel equals the reference's ``softcap * tanh(logit / softcap)``; the
    inputs are scaled so that many logits sit in tanh's curved range (cap 5) or mostly in its linear one (cap 50)."""
    B, Hq, Hkv, D, N, block_size, S = ATTENTION_CASES[case]
    q, k, v, indices, counts, kv_start, kv_end = _attention_inputs(B, Hq, Hkv, D, N, block_size, S)
    q = 4 * q
    with nan_poisoned_allocations():
        out = sparse_decode_attention(q, k, v, indices, counts, kv_start, kv_end, block_size, softcap=softcap,
                                      num_splits=2)
    expected = sparse_decode_attention_ref(q, k, v, indices, counts, kv_start, kv_end, block_size, softcap=softcap)
    assert rel_rms(out, expected) < FP32_TOL
    uncapped = sparse_decode_attention_ref(q, k, v, indices, counts, kv_start, kv_end, block_size)
    assert rel_rms(uncapped, expected) > 10 * FP32_TOL  # the cap changes the result: the comparison can fail


def test_softcapped_reference_is_gemma2s_eager_attention():
    """The reference's softcap is Gemma 2's eager attention (scores scaled, capped, masked, softmax) on every key."""
    B, Hq, Hkv, D, N = 2, 4, 2, 16, 30
    q, k, v, _, _, _, _ = _attention_inputs(B, Hq, Hkv, D, N, 1, 1)
    everything = torch.arange(N, dtype=torch.int32).expand(B, Hkv, N).contiguous()
    full = torch.full((B, Hkv), N, dtype=torch.int32)
    start, end = torch.zeros(B, dtype=torch.int32), torch.full((B,), N, dtype=torch.int32)
    out = sparse_decode_attention_ref(4 * q, k, v, everything, full, start, end, 1, scale=0.3, softcap=5.0)
    keys = k.repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.tanh(torch.einsum("bhd,bhnd->bhn", 4 * q, keys) * 0.3 / 5.0) * 5.0
    expected = torch.einsum("bhn,bhnd->bhd", scores.softmax(-1), v.repeat_interleave(Hq // Hkv, dim=1))
    assert rel_rms(out, expected) < FP32_TOL


def test_sparse_decode_attention_empty_rows_give_zeros_and_full_selection_is_dense():
    """counts = 0 -> zeros; selecting every position equals dense softmax attention (SDPA) exactly (fp32)."""
    B, Hq, Hkv, D, N = 2, 9, 3, 64, 75
    q, k, v, _, _, _, _ = _attention_inputs(B, Hq, Hkv, D, N, 1, 1)
    everything = torch.arange(N, dtype=torch.int32).expand(B, Hkv, N).contiguous()
    full = torch.full((B, Hkv), N, dtype=torch.int32)
    start, end = torch.zeros(B, dtype=torch.int32), torch.full((B,), N, dtype=torch.int32)
    out = sparse_decode_attention(q, k, v, everything, full, start, end, 1, num_splits=2)
    dense = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    assert rel_rms(out, dense) < FP32_TOL
    empty = sparse_decode_attention(q, k, v, everything, torch.zeros_like(full), start, end, 1)
    assert torch.equal(empty, torch.zeros_like(empty))


def test_a_static_cache_counter_expanded_to_the_rows_is_read_in_place():
    """kv_end as the engine passes it: a static layer's 0-dim int64 length counter expanded to the rows (stride 0),
    kv_start int64: the same output as int32 contiguous bounds."""
    B, Hq, Hkv, D, N = 3, 9, 3, 64, 75
    q, k, v, _, _, kv_start, _ = _attention_inputs(B, Hq, Hkv, D, N, 1, 1)
    everything = torch.arange(N, dtype=torch.int32).expand(B, Hkv, N).contiguous()
    full = torch.full((B, Hkv), N, dtype=torch.int32)
    counter = torch.tensor(N - 5)
    out = sparse_decode_attention(q, k, v, everything, full, kv_start.long(), counter.expand(B), 1)
    kv_end = torch.full((B,), N - 5, dtype=torch.int32)
    expected = sparse_decode_attention(q, k, v, everything, full, kv_start, kv_end, 1)
    assert torch.equal(out, expected)


SCORE_CASES = {"P1": 1, "P63": 63, "P75": 75}


@pytest.mark.parametrize("num_pages", list(SCORE_CASES.values()), ids=list(SCORE_CASES))
def test_quest_page_scores_match_reference_fp32(num_pages):
    gen = torch.Generator().manual_seed(1)
    B, Hq, Hkv, D, page = 2, 9, 3, 64, 16
    q = torch.randn(B, Hq, D, generator=gen)
    a, b = torch.randn(2, B, Hkv, num_pages + 5, D, generator=gen)  # capacity beyond the valid pages
    page_min, page_max = torch.minimum(a, b), torch.maximum(a, b)
    kv_start = torch.tensor([0, 37], dtype=torch.int32)  # row 1: pages 0 and 1 are padding only
    with nan_poisoned_allocations():
        scores = quest_page_scores(q, page_min, page_max, num_pages, kv_start, page)
    expected = quest_page_scores_ref(q, page_min, page_max, num_pages, kv_start, page)
    assert torch.equal(torch.isinf(scores), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    assert finite[0].all() and rel_rms(scores[finite], expected[finite]) < FP32_TOL
    # Quest's score bounds every key inside the page: q.k <= score for the group's best head
    keys = page_min + torch.rand(page_min.shape, generator=gen) * (page_max - page_min)
    logits = torch.einsum("bhgd,bhpd->bhgp", q.view(B, Hkv, 3, D), keys[:, :, :num_pages]).amax(2)
    assert (logits[finite] <= scores[finite] + 1e-4).all()


@pytest.mark.parametrize("num_clusters", list(SCORE_CASES.values()), ids=list(SCORE_CASES))
def test_cluster_scores_match_reference_fp32(num_clusters):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 9, 64, generator=gen)
    centroids = torch.randn(2, 3, num_clusters + 3, 64, generator=gen)
    with nan_poisoned_allocations():
        scores = cluster_scores(q, centroids, num_clusters)
        scaled = cluster_scores(q, centroids, num_clusters, scale=0.125)
    expected = cluster_scores_ref(q, centroids, num_clusters)
    assert rel_rms(scores, expected) < FP32_TOL
    # SeerAttention's gate scale, applied in the kernel: a power of two, so exactly the unscaled scores times it
    assert torch.equal(scaled, scores * 0.125)
    assert torch.equal(cluster_scores_ref(q, centroids, num_clusters, scale=0.125), expected * 0.125)


TOPK_CASES = {"P1-k1": (1, 1), "P63-k5": (63, 5), "P75-k75": (75, 75), "P75-k16": (75, 16), "P8192-k128": (8192, 128)}


def _topk_scores(P, device="cpu"):
    """Rows with -inf padding, exact ties, signed zeros and many repeated values (where tie-breaking matters)."""
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(5, P, generator=gen)
    scores[0, : P // 3] = float("-inf")
    scores[1, ::3] = 0.5
    scores[2] = torch.randint(-2, 2, (P,), generator=gen).float()
    scores[3, : P // 2] = -0.0
    scores[4, : P // 2] = 0.0
    return scores.to(device)


@pytest.mark.parametrize("case", list(TOPK_CASES), ids=list(TOPK_CASES))
def test_topk_indices_match_reference_exactly(case):
    """Exact integer output (no tolerance): same k positions, ascending, ties to the lowest position."""
    P, k = TOPK_CASES[case]
    scores = _topk_scores(P)
    with nan_poisoned_allocations():
        indices = topk_indices(scores, k)
    expected = topk_indices_ref(scores, k)
    assert torch.equal(indices, expected)
    # the chosen scores are the k largest: same multiset of values as torch.topk
    chosen = scores.gather(1, indices.long()).sort(-1).values
    assert torch.equal(chosen, torch.topk(scores, k, dim=-1).values.sort(-1).values)


# (Hkv, P, k, block_size, kv_end): kv_end 1, 63, 75 written positions (T awkward); Hkv=3 is SmolLM2's
BLOCK_TOPK_CASES = {
    "T1-P5-k2-page16": (3, 5, 2, 16, 1),
    "T63-P16-k4-page4": (3, 16, 4, 4, 63),
    "T75-P75-k75-tokens": (3, 75, 75, 1, 75),
    "T75-P19-k5-page4": (1, 19, 5, 4, 75),
}


def _block_topk_inputs(Hkv, P, block_size, written, device="cpu"):
    """Scores with ties and -inf, row 0 unpadded, row 1 left-padded past its first blocks (kv_start 37 clipped to
    the written length), kv_end one shared counter expanded to the rows (stride 0), as a static cache keeps it."""
    scores = _topk_scores(P, device)[:2].repeat_interleave(Hkv, 0).view(2, Hkv, P)
    scores[1, -1] = torch.arange(P, 0, -1, device=device, dtype=torch.float32)  # the best blocks first
    kv_start = torch.tensor([0, min(37, written - 1)], device=device, dtype=torch.int32)
    kv_end = torch.full((1,), written, device=device, dtype=torch.int64).expand(2)
    return scores, kv_start, kv_end


@pytest.mark.parametrize("case", list(BLOCK_TOPK_CASES), ids=list(BLOCK_TOPK_CASES))
def test_block_topk_matches_reference_exactly(case):
    """Exact integer output: the same blocks as the reference's overrides + top-k; the newest block always chosen, a
    block of padding or unwritten positions only never chosen while other blocks remain; the scores untouched."""
    Hkv, P, k, block_size, written = BLOCK_TOPK_CASES[case]
    scores, kv_start, kv_end = _block_topk_inputs(Hkv, P, block_size, written)
    before = scores.clone()
    with nan_poisoned_allocations():
        indices = block_topk(scores, k, kv_start, kv_end, block_size)
    expected = block_topk_ref(scores, k, kv_start, kv_end, block_size)
    assert torch.equal(indices, expected)
    assert torch.equal(scores, before)
    newest = (written - 1) // block_size
    assert (indices == newest).any(-1).all()
    for b in range(2):
        first = torch.arange(P) * block_size
        usable = ((first + block_size > kv_start[b]) & (first < written)).sum().item()
        chosen_first = indices[b].long() * block_size
        empty_chosen = (chosen_first + block_size <= kv_start[b]) | (chosen_first >= written)
        assert empty_chosen.sum(-1).max().item() == max(0, k - usable)


QUEST_PAGE_CASES = {"T1": 1, "T63": 63, "T75": 75, "T40-padding-only": 40}


def _quest_page_inputs(written, dtype=torch.float32, device="cpu"):
    """keys [2, 3, 75, 48] (N = 75: the last page of 16 runs past the buffer), metadata of 5 pages filled with
    random values (pages the update must not touch), row 1 left-padded up to 37 (43 in the padding-only case: its
    page 2, positions 32-47, then holds no valid key of row 1 at written = 40)."""
    gen = torch.Generator(device=device).manual_seed(5)
    keys = torch.randn(2, 3, 75, 48, generator=gen, device=device).to(dtype)
    page_min = torch.randn(2, 3, 5, 48, generator=gen, device=device).to(dtype)
    page_max = torch.randn(2, 3, 5, 48, generator=gen, device=device).to(dtype)
    start = 43 if written == 40 else min(37, written - 1)
    kv_start = torch.tensor([0, start], device=device, dtype=torch.int32)
    kv_end = torch.tensor([written, written], device=device, dtype=torch.int32)
    write_pos = torch.tensor([written], device=device, dtype=torch.long)
    return keys, page_min, page_max, write_pos, kv_start, kv_end


@pytest.mark.parametrize("written", list(QUEST_PAGE_CASES.values()), ids=list(QUEST_PAGE_CASES))
def test_quest_page_update_matches_reference_exactly(written):
    """Min and max are exact in any precision, so the kernel's metadata must equal the reference's bit for bit:
    the updated page's bounds, zeros where a row has no valid key in it, every other page untouched."""
    keys, page_min, page_max, write_pos, kv_start, kv_end = _quest_page_inputs(written)
    expected_min, expected_max = page_min.clone(), page_max.clone()
    quest_page_update_ref(keys, expected_min, expected_max, write_pos, kv_start, kv_end, 16)
    untouched_min = page_min.clone()
    quest_page_update(keys, page_min, page_max, write_pos, kv_start, kv_end, 16)
    assert torch.equal(page_min, expected_min) and torch.equal(page_max, expected_max)
    page = (written - 1) // 16
    others = [p for p in range(5) if p != page]
    assert torch.equal(page_min[:, :, others], untouched_min[:, :, others])
    first = page * 16
    row0 = keys[0, :, first:written]
    assert torch.equal(page_min[0, :, page], row0.amin(1)) and torch.equal(page_max[0, :, page], row0.amax(1))
    if written == 40:
        assert (page_min[1, :, page] == 0).all() and (page_max[1, :, page] == 0).all()


# (N, width): N = 1, 63, 75 awkward; 2500 spans three scan blocks of 1024; width below, between and above the counts
MASK_CASES = {"N1-w1": (1, 1), "N63-w16": (63, 16), "N75-w40": (75, 40), "N75-w200": (75, 200),
              "N2500-w300": (2500, 300), "N2500-w2048": (2500, 2048)}


@pytest.mark.parametrize("case", list(MASK_CASES), ids=list(MASK_CASES))
def test_mask_positions_match_reference_exactly(case):
    """Exact integer output: the masked positions ascending, then the others, cut at the width; counts clipped to
    it. Rows: sparse random, dense random, none, all, and one read through an expanded (stride-0) view."""
    N, width = MASK_CASES[case]
    gen = torch.Generator().manual_seed(6)
    mask = torch.stack([torch.rand(N, generator=gen) < 0.05, torch.rand(N, generator=gen) < 0.6,
                        torch.zeros(N, dtype=torch.bool), torch.ones(N, dtype=torch.bool)])
    for rows in (mask, mask[1:2].expand(3, N)):
        with nan_poisoned_allocations():
            positions, counts = mask_positions(rows, width)
        expected_positions, expected_counts = mask_positions_ref(rows, width)
        assert torch.equal(positions, expected_positions) and torch.equal(counts, expected_counts)
    kept = min(width, N)
    assert positions.shape == (3, kept)
    assert counts.tolist() == [min(int(mask[1].sum()), kept)] * 3
    listed = positions[0, : counts[0]].long()
    assert mask[1, listed].all() and (listed.diff() > 0).all()


# (N, clusters, n_sink, budget): N = 1, 63, 75 awkward; 2500 spans three blocks of 1024; n_sink 0 (no sinks) and 4
CLUSTER_MASK_CASES = {"N1": (1, 3, 0, 8), "N63": (63, 5, 4, 16), "N75": (75, 7, 4, 40), "N2500": (2500, 40, 4, 600)}


def _cluster_mask_inputs(N, clusters, n_sink, budget, device="cpu"):
    """Two rows of 3 kv heads: the first without padding, the second left-padded; cluster ids -1 (not clustered) to
    clusters-1 with the tail unclustered (clustered_upto at 3/4 of N); about half of the clusters taken
    (kv_start/kv_end as the int32 [B] the cache keeps)."""
    gen = torch.Generator().manual_seed(N + clusters)
    B, H = 2, 3
    assign = torch.randint(-1, clusters, (B, H, N), generator=gen, dtype=torch.int32)
    clustered_upto = N - N // 4
    assign[..., clustered_upto:] = -1
    taken = torch.rand(B, H, clusters, generator=gen) < 0.5
    kv_start = torch.tensor([0, N // 5], dtype=torch.int32)
    kv_end = torch.tensor([N, max(N // 5 + 1, N - 3)], dtype=torch.int32)
    inputs = (assign, taken, kv_start, kv_end, torch.tensor([clustered_upto], dtype=torch.long))
    return [t.to(device) for t in inputs] + [budget, n_sink]


@pytest.mark.parametrize("case", list(CLUSTER_MASK_CASES), ids=list(CLUSTER_MASK_CASES))
def test_cluster_token_mask_matches_reference_exactly(case):
    """Exact boolean output: a position is in the mask iff its cluster is taken or it is a sink or recent valid
    position; checked element by element against the reference and against the definition at chosen positions."""
    N = CLUSTER_MASK_CASES[case][0]
    inputs = _cluster_mask_inputs(*CLUSTER_MASK_CASES[case])
    assign, taken, kv_start, kv_end, clustered_upto, budget, n_sink = inputs
    mask = cluster_token_mask(*inputs)
    assert mask.dtype == torch.bool and mask.shape == (2, 3, N)
    assert torch.equal(mask, cluster_token_mask_ref(*inputs))
    b, h = 1, 2
    recent_from = max(int(clustered_upto), int(kv_end[b]) - (budget - n_sink))
    for p in {0, N // 5, N // 2, N - 1}:
        cluster = int(assign[b, h, p])
        in_row = int(kv_start[b]) <= p < int(kv_end[b])
        fixed = in_row and (p < int(kv_start[b]) + n_sink or p >= recent_from)
        assert bool(mask[b, h, p]) == ((cluster >= 0 and bool(taken[b, h, cluster])) or fixed)


def test_fixed_count_equals_the_fixed_positions():
    """ClusterKV's room for clusters is the budget less the sinks and recent tokens it reads anyway, counted from the
    bounds (no pass over the buffer): equal to the count of ``fixed_positions`` for every row shape of a 20-position
    buffer (clustered_upto before, inside and after the row; the newest budget - n_sink tokens past it; sinks
    overlapping the recent tokens; an empty row)."""
    N = 20
    rows = [(start, end) for start in range(0, 6) for end in range(start, N + 1)]
    kv_start = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    kv_end = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    for clustered_upto in range(0, N + 2, 3):
        for budget, n_sink in ((4, 0), (6, 2), (8, 4), (30, 4)):
            upto = torch.tensor([clustered_upto])
            counted = fixed_count(kv_start, kv_end, upto, budget, n_sink)
            expected = fixed_positions(kv_start, kv_end, upto, budget, n_sink, N).sum(-1, keepdim=True)
            assert torch.equal(counted, expected), (clustered_upto, budget, n_sink)


# (clusters, budget, clustered_upto): C = 1, 7, 75 awkward, 130 spans three blocks of 64; budgets leaving no room,
# some and all; nothing clustered yet (the newest budget - n_sink tokens are the recent ones) or all but 20 tokens
CLUSTER_TAKE_CASES = {"C1": (1, 40, 280), "C7-none-clustered": (7, 30, 0), "C75": (75, 200, 280),
                      "C130-tight": (130, 24, 280), "C130-all": (130, 100000, 280)}


def _cluster_take_inputs(C, budget, clustered_upto, device="cpu"):
    """Three rows of 3 kv heads: sizes 0 (empty slots) to 9, scores rounded to a coarse grid so that ties are common
    (broken by the lower slot); the second row left-padded; the third holding 3 positions, fewer than its sinks, so
    that its recent tokens overlap them where nothing is clustered."""
    gen = torch.Generator().manual_seed(C + budget)
    B, H, N = 3, 3, 300
    scores = (torch.randn(B, H, C, generator=gen) * 2).round() / 2
    sizes = torch.randint(0, 10, (B, H, C), generator=gen, dtype=torch.int32)
    kv_start = torch.tensor([0, 37, 37], dtype=torch.int32)
    kv_end = torch.tensor([N, N - 5, 40], dtype=torch.int32)
    inputs = (scores, sizes, kv_start, kv_end, torch.tensor([clustered_upto], dtype=torch.long))
    return [t.to(device) for t in inputs] + [budget, 4]


@pytest.mark.parametrize("case", list(CLUSTER_TAKE_CASES), ids=list(CLUSTER_TAKE_CASES))
def test_cluster_take_matches_reference_exactly(case):
    """Exact boolean output against the sort-and-prefix-sum reference; and the rule itself on one row: the taken
    clusters' sizes fit in the room, and every cluster ranked ahead of a taken one is taken."""
    C = CLUSTER_TAKE_CASES[case][0]
    inputs = _cluster_take_inputs(*CLUSTER_TAKE_CASES[case])
    scores, sizes, kv_start, kv_end, clustered_upto, budget, n_sink = inputs
    with nan_poisoned_allocations():
        taken = cluster_take(*inputs)
    assert taken.dtype == torch.bool and taken.shape == (3, 3, C)
    assert torch.equal(taken, cluster_take_ref(*inputs))
    room = budget - int(fixed_count(kv_start, kv_end, clustered_upto, budget, n_sink)[1])
    row_taken, row_sizes = taken[1, 2], sizes[1, 2].long()
    assert int(row_sizes[row_taken].sum()) <= max(room, 0)
    ranked = scores[1, 2].masked_fill(row_sizes == 0, float("-inf"))
    order = torch.argsort(ranked, descending=True, stable=True)
    flags = row_taken[order]
    assert not (flags[1:] & ~flags[:-1]).any()  # taken ranks form a prefix of the ranking


# (written, block_size): the block of the newest token, its last block running past the buffer (N = 75)
POOL_CASES = {"T1-block64": (1, 64), "T63-block16": (63, 16), "T75-block64": (75, 64), "T40-padding-only": (40, 16)}


@pytest.mark.parametrize("case", list(POOL_CASES), ids=list(POOL_CASES))
def test_pool_newest_block_matches_reference_fp32(case):
    """Max and min exact; the mean within FP32_TOL (another summation order); zeros for a row whose block holds no
    valid key (row 1 of the padding-only case); every output element written (NaN-poisoned allocations)."""
    written, block_size = POOL_CASES[case]
    keys, _, _, write_pos, kv_start, kv_end = _quest_page_inputs(written)
    with nan_poisoned_allocations():
        pooled = pool_newest_block(keys, write_pos, kv_start, kv_end, block_size)
    expected = pool_newest_block_ref(keys, write_pos, kv_start, kv_end, block_size)
    D = keys.shape[-1]
    assert pooled.shape == expected.shape == (2, 3, 1, 3 * D)
    assert torch.equal(pooled[..., : 2 * D], expected[..., : 2 * D])
    assert rel_rms(pooled[..., 2 * D :], expected[..., 2 * D :]) < FP32_TOL
    first = (written - 1) // block_size * block_size
    row0 = keys[0, :, first:written]
    assert torch.allclose(pooled[0, :, 0, 2 * D :], row0.mean(1), atol=1e-6)
    if case == "T40-padding-only":
        assert (pooled[1] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(POOL_CASES), ids=list(POOL_CASES))
def test_pool_newest_block_bf16_gpu(case):
    written, block_size = POOL_CASES[case]
    keys, _, _, write_pos, kv_start, kv_end = _quest_page_inputs(written, torch.bfloat16, "cuda")
    pooled = pool_newest_block(keys, write_pos, kv_start, kv_end, block_size)
    expected = pool_newest_block_ref(keys, write_pos, kv_start, kv_end, block_size)
    D = keys.shape[-1]
    assert torch.equal(pooled[..., : 2 * D], expected[..., : 2 * D])  # bf16 values, exact in fp32
    assert rel_rms(pooled[..., 2 * D :], expected[..., 2 * D :]) < FP32_TOL  # fp32 sums of the same bf16 values


def _gate_key_inputs(written, dtype=torch.float32, device="cpu"):
    """The pool cases' keys [2, 3, 75, 48] and bounds, gate keys of 5 blocks (random: blocks the update must not
    touch) and a key projection of hidden 40 (the kernel's chunks of 32 hidden units end in a partial one)."""
    keys, _, _, write_pos, kv_start, kv_end = _quest_page_inputs(written, dtype, device)
    gen = torch.Generator(device=device).manual_seed(6)
    gate_keys = torch.randn(2, 3, 5, 40, generator=gen, device=device).to(dtype)
    weight = (torch.randn(40, 3 * 48, generator=gen, device=device) / 12).to(dtype)
    return keys, gate_keys, weight, write_pos, kv_start, kv_end


@pytest.mark.parametrize("case", list(POOL_CASES), ids=list(POOL_CASES))
def test_seer_gate_key_update_matches_reference_fp32(case):
    """The block of the newest token gets ``weight . pooled`` within FP32_TOL (another summation order over the 144
    pooled channels); every other block stays bit for bit; a row whose block holds no valid key gets the projection
    of zeros, i.e. zeros (row 1 of the padding-only case)."""
    written, block_size = POOL_CASES[case]
    keys, gate_keys, weight, write_pos, kv_start, kv_end = _gate_key_inputs(written)
    expected = gate_keys.clone()
    seer_gate_key_update_ref(keys, expected, weight, write_pos, kv_start, kv_end, block_size)
    before = gate_keys.clone()
    seer_gate_key_update(keys, gate_keys, weight, write_pos, kv_start, kv_end, block_size)
    block = (written - 1) // block_size
    others = [n for n in range(gate_keys.shape[2]) if n != block]
    assert torch.equal(gate_keys[:, :, others], before[:, :, others])
    assert not torch.equal(expected[:, :, block], before[:, :, block])
    assert rel_rms(gate_keys[:, :, block], expected[:, :, block]) < FP32_TOL
    pooled = pool_newest_block_ref(keys, write_pos, kv_start, kv_end, block_size)
    assert torch.allclose(gate_keys[:, :, block], pooled[:, :, 0] @ weight.T, atol=1e-5)
    if case == "T40-padding-only":
        assert (gate_keys[1, :, block] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(POOL_CASES), ids=list(POOL_CASES))
def test_seer_gate_key_update_bf16_gpu(case):
    written, block_size = POOL_CASES[case]
    keys, gate_keys, weight, write_pos, kv_start, kv_end = _gate_key_inputs(written, torch.bfloat16, "cuda")
    expected = gate_keys.clone()
    seer_gate_key_update_ref(keys, expected, weight, write_pos, kv_start, kv_end, block_size)
    seer_gate_key_update(keys, gate_keys, weight, write_pos, kv_start, kv_end, block_size)
    # both project the same bf16 pooled values with fp32 sums and round to bf16 once: a rounding step apart at most
    assert rel_rms(gate_keys, expected) < BF16_TOL
    block = (written - 1) // block_size
    others = [n for n in range(gate_keys.shape[2]) if n != block]
    assert torch.equal(gate_keys[:, :, others], expected[:, :, others])


@pytest.mark.gpu
@pytest.mark.parametrize("written", list(QUEST_PAGE_CASES.values()), ids=list(QUEST_PAGE_CASES))
def test_quest_page_update_bf16_gpu(written):
    keys, page_min, page_max, write_pos, kv_start, kv_end = _quest_page_inputs(written, torch.bfloat16, "cuda")
    expected_min, expected_max = page_min.clone(), page_max.clone()
    quest_page_update_ref(keys, expected_min, expected_max, write_pos, kv_start, kv_end, 16)
    quest_page_update(keys, page_min, page_max, write_pos, kv_start, kv_end, 16)
    assert torch.equal(page_min, expected_min) and torch.equal(page_max, expected_max)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [75, 2500, 131072], ids=["N75", "N2500", "N131072"])
def test_mask_positions_gpu(N):
    gen = torch.Generator(device="cuda").manual_seed(7)
    mask = torch.rand(8, N, device="cuda", generator=gen) < 0.03
    for width in (16, 2048):
        positions, counts = mask_positions(mask, width)
        expected_positions, expected_counts = mask_positions_ref(mask, width)
        assert torch.equal(positions, expected_positions) and torch.equal(counts, expected_counts)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CLUSTER_MASK_CASES), ids=list(CLUSTER_MASK_CASES))
def test_cluster_token_mask_gpu(case):
    inputs = _cluster_mask_inputs(*CLUSTER_MASK_CASES[case], device="cuda")
    assert torch.equal(cluster_token_mask(*inputs), cluster_token_mask_ref(*inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CLUSTER_TAKE_CASES), ids=list(CLUSTER_TAKE_CASES))
def test_cluster_take_gpu(case):
    inputs = _cluster_take_inputs(*CLUSTER_TAKE_CASES[case], device="cuda")
    assert torch.equal(cluster_take(*inputs), cluster_take_ref(*inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(BLOCK_TOPK_CASES), ids=list(BLOCK_TOPK_CASES))
def test_block_topk_gpu(case):
    Hkv, P, k, block_size, written = BLOCK_TOPK_CASES[case]
    scores, kv_start, kv_end = _block_topk_inputs(Hkv, P, block_size, written, "cuda")
    assert torch.equal(block_topk(scores, k, kv_start, kv_end, block_size),
                       block_topk_ref(scores, k, kv_start, kv_end, block_size))


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(TOPK_CASES), ids=list(TOPK_CASES))
def test_topk_indices_gpu(case):
    P, k = TOPK_CASES[case]
    scores = _topk_scores(P, "cuda")
    assert torch.equal(topk_indices(scores, k), topk_indices_ref(scores, k))


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["uncapped", "cap5"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES), ids=list(ATTENTION_CASES))
def test_sparse_decode_attention_bf16_gpu(case, softcap):
    B, Hq, Hkv, D, N, block_size, S = ATTENTION_CASES[case]
    q, k, v, indices, counts, kv_start, kv_end = _attention_inputs(B, Hq, Hkv, D, N, block_size, S,
                                                                   dtype=torch.bfloat16, device="cuda")
    with nan_poisoned_allocations():
        out = sparse_decode_attention(q, k, v, indices, counts, kv_start, kv_end, block_size, softcap=softcap)
    expected = sparse_decode_attention_ref(q, k, v, indices, counts, kv_start, kv_end, block_size, softcap=softcap)
    assert rel_rms(out, expected) < BF16_TOL


@pytest.mark.gpu
def test_sparse_decode_attention_bf16_gpu_llama3_shapes():
    """Llama-3-8B decode shapes at 32K context, budget 2048 in pages of 16, batch 8 (the benchmark's setting)."""
    B, Hq, Hkv, D, N, page = 8, 32, 8, 128, 32768, 16
    q, k, v, _, _, kv_start, kv_end = _attention_inputs(B, Hq, Hkv, D, N, page, 1, dtype=torch.bfloat16,
                                                        device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    indices = torch.rand(B, Hkv, N // page, device="cuda", generator=gen).topk(2048 // page).indices.to(torch.int32)
    counts = torch.full((B, Hkv), 2048 // page, device="cuda", dtype=torch.int32)
    out = sparse_decode_attention(q, k, v, indices, counts, kv_start, kv_end, page)
    expected = sparse_decode_attention_ref(q, k, v, indices, counts, kv_start, kv_end, page)
    assert rel_rms(out, expected) < BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("num_pages", [1, 63, 75, 8192], ids=["P1", "P63", "P75", "P8192"])
def test_scores_bf16_gpu(num_pages):
    gen = torch.Generator(device="cuda").manual_seed(3)
    B, Hq, Hkv, D = 2, 32, 8, 128
    q = torch.randn(B, Hq, D, device="cuda", generator=gen).bfloat16()
    a, b = torch.randn(2, B, Hkv, num_pages, D, device="cuda", generator=gen).bfloat16()
    page_min, page_max = torch.minimum(a, b), torch.maximum(a, b)
    kv_start = torch.tensor([0, 20], device="cuda", dtype=torch.int32)
    scores = quest_page_scores(q, page_min, page_max, num_pages, kv_start, 16)
    expected = quest_page_scores_ref(q, page_min, page_max, num_pages, kv_start, 16)
    finite = ~torch.isinf(expected)
    assert torch.equal(torch.isinf(scores), ~finite)
    assert rel_rms(scores[finite], expected[finite]) < BF16_TOL  # fp32 accumulation of exact bf16 products
    assert rel_rms(cluster_scores(q, a, num_pages), cluster_scores_ref(q, a, num_pages)) < BF16_TOL

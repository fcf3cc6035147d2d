"""tools/flex_peer.py: the FlexAttention BlockMask computes exactly ``vertical_slash_mask``, Flex's output and
gradients equal ``reference_sparse_attention``, and block-only patterns have the density asked for.

On CPU FlexAttention runs unfused math that evaluates the ``mask_mod`` everywhere, so the block lists the GPU
kernels follow are checked on their own: a full block counts whole, a partial block through the ``mask_mod``,
an unlisted block not at all — the mask that the compiled kernels compute.
"""

import pytest
import torch
from document_cases import packed_documents, random_lengths
from patterns import random_index
from tool_modules import load_tool
from torch.nn.attention.flex_attention import create_mask, flex_attention

from mtraining_kernels.document_index import DocumentIndex
from mtraining_kernels.layout import BLOCK_SIZE
from mtraining_kernels.reference import packed_vertical_slash_mask, reference_sparse_attention, vertical_slash_mask
from mtraining_kernels.vertical_slash import mask_area

flex_peer = load_tool("flex_peer")
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def listed_blocks(num_blocks: torch.Tensor, indices: torch.Tensor, width: int) -> torch.Tensor:
    """FlexAttention's ordered lists (num ``[b, H, rows]``, indices ``[b, H, rows, ·]``) → bool
    ``[b, H, rows, width]``."""
    slots = torch.arange(indices.shape[-1]) < num_blocks[..., None]
    dense = torch.zeros(*indices.shape[:-1], width + 1, dtype=torch.bool)
    dense.scatter_(-1, torch.where(slots, indices.long(), width), True)
    return dense[..., :width]


def kernel_mask(block_mask, batch: int, heads: int, seq_len: int) -> torch.Tensor:
    """The mask FlexAttention's block-sparse kernels compute: bool ``[b, H, N, N]``."""
    num_blocks = seq_len // BLOCK_SIZE
    full = listed_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, num_blocks)
    partial = listed_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, num_blocks)
    assert not (full & partial).any()
    # the backward walks the same blocks by key block
    assert torch.equal(
        listed_blocks(block_mask.full_q_num_blocks, block_mask.full_q_indices, num_blocks), full.transpose(-1, -2)
    )
    assert torch.equal(
        listed_blocks(block_mask.q_num_blocks, block_mask.q_indices, num_blocks), partial.transpose(-1, -2)
    )

    def tokens(blocks):
        return blocks.repeat_interleave(BLOCK_SIZE, -1).repeat_interleave(BLOCK_SIZE, -2)

    mask_mod = create_mask(block_mask.mask_mod, batch, heads, seq_len, seq_len, device="cpu")
    return tokens(full) | (tokens(partial) & mask_mod)


def block_only_index(batch, heads, seq_len, generator):
    """A block-only pattern as dense as a random vertical-slash pattern (the target area per head too)."""
    v_idx, s_idx = random_index(batch, heads, seq_len, 24, 10, generator)
    target = mask_area(v_idx, s_idx, seq_len)
    return (*flex_peer.block_only_pattern(target, seq_len, generator), target)


@pytest.mark.parametrize("forced", [True, False])
def test_block_mask_is_exactly_the_vertical_slash_mask(seed, forced):
    batch, heads, seq_len = 2, 4, 1024
    v_idx, s_idx = random_index(batch, heads, seq_len, 40, 12, torch.Generator().manual_seed(seed), forced=forced)
    block_mask = flex_peer.vertical_slash_block_mask(v_idx, s_idx, seq_len)
    assert block_mask.BLOCK_SIZE == (BLOCK_SIZE, BLOCK_SIZE) and block_mask.shape == (batch, heads, seq_len, seq_len)
    expected = vertical_slash_mask(v_idx, s_idx, seq_len)
    assert torch.equal(kernel_mask(block_mask, batch, heads, seq_len), expected)
    assert torch.equal(create_mask(block_mask.mask_mod, batch, heads, seq_len, seq_len, device="cpu"), expected)


def test_block_only_block_mask_is_exactly_its_pattern(seed):
    batch, heads, seq_len = 2, 4, 1024
    v_idx, s_idx, _ = block_only_index(batch, heads, seq_len, torch.Generator().manual_seed(seed))
    assert bool((v_idx == seq_len).all()) and bool((s_idx % BLOCK_SIZE == 0).all())
    block_mask = flex_peer.block_only_block_mask(s_idx, seq_len)
    expected = vertical_slash_mask(v_idx, s_idx, seq_len)
    assert torch.equal(kernel_mask(block_mask, batch, heads, seq_len), expected)
    assert torch.equal(create_mask(block_mask.mask_mod, batch, heads, seq_len, seq_len, device="cpu"), expected)
    # no verticals: only the diagonal blocks are partial
    assert bool((block_mask.kv_num_blocks == 1).all())


def test_document_causal_block_mask_is_exactly_the_dense_packed_mask(seed):
    """Every document dense: the packed reference mask; full blocks only inside one document, none skipped."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = 1024
    documents = packed_documents([random_lengths(generator, seq_len), [BLOCK_SIZE, 3 * BLOCK_SIZE, 512]], seq_len)
    dense = DocumentIndex.dense(documents, heads=1)
    block_mask = flex_peer.document_causal_block_mask(documents.doc_id)
    expected = packed_vertical_slash_mask(dense)  # [b, 1, N, N]
    assert torch.equal(kernel_mask(block_mask, 2, 1, seq_len), expected)
    assert torch.equal(create_mask(block_mask.mask_mod, 2, 1, seq_len, seq_len, device="cpu"), expected)
    # sample 1: documents on block boundaries, so every listed block is full but the diagonal ones
    assert bool((block_mask.kv_num_blocks[1] == 1).all())


@pytest.mark.parametrize("pattern", ["vertical_slash", "block_only"])
def test_flex_output_and_gradients_equal_the_reference(seed, pattern):
    batch, heads, kv_heads, seq_len, dim = 1, 4, 2, 640, 64
    generator = torch.Generator().manual_seed(seed)
    if pattern == "vertical_slash":
        v_idx, s_idx = random_index(batch, heads, seq_len, 40, 8, generator, forced=False)
        block_mask = flex_peer.vertical_slash_block_mask(v_idx, s_idx, seq_len)
    else:
        v_idx, s_idx, _ = block_only_index(batch, heads, seq_len, generator)
        block_mask = flex_peer.block_only_block_mask(s_idx, seq_len)
    q, k, v, dout = (
        torch.randn(batch, seq_len, h, dim, generator=generator) for h in (heads, kv_heads, kv_heads, heads)
    )
    scale = 0.9 * dim**-0.5
    out, dq, dk, dv = flex_peer.flex_fwd_bwd(q, k, v, dout, block_mask, scale)

    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, _ = reference_sparse_attention(*inputs, vertical_slash_mask(v_idx, s_idx, seq_len), scale)
    expected = (ref_out, *torch.autograd.grad(ref_out, inputs, dout))
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), expected):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # the public eager function (forward only on CPU) agrees with the operator flex_forward calls
    public = flex_attention(
        *(flex_peer.heads_first(x) for x in (q, k, v)), block_mask=block_mask, scale=scale, enable_gqa=True
    )
    torch.testing.assert_close(public.transpose(1, 2), out, rtol=1e-5, atol=1e-6)


def test_block_only_pattern_has_the_target_density(seed):
    batch, heads, seq_len = 2, 4, 32768
    num_blocks = seq_len // BLOCK_SIZE
    v_idx, s_idx, target = block_only_index(batch, heads, seq_len, torch.Generator().manual_seed(seed))
    area = mask_area(v_idx, s_idx, seq_len)
    assert bool((area <= target).all())
    # the shortfall is under one block plus the smallest unused distance's blocks (distance δ adds nb − δ)
    distance = torch.arange(num_blocks)
    used = torch.zeros(batch, heads, num_blocks + 1, dtype=torch.bool)
    used.scatter_(-1, torch.where(s_idx < seq_len, s_idx.long() // BLOCK_SIZE, num_blocks), True)
    used = used[..., :num_blocks] | (distance == 0)
    smallest_unused = torch.where(used, num_blocks, num_blocks - distance).amin(-1)
    assert bool(((target - area) < BLOCK_SIZE**2 * (1 + smallest_unused)).all())
    total = seq_len * (seq_len + 1) / 2
    torch.testing.assert_close(area / total, target / total, rtol=1e-2, atol=0)


def test_block_only_pattern_never_goes_below_the_diagonal_and_distance_one():
    seq_len = 1024
    v_idx, s_idx = flex_peer.block_only_pattern(
        torch.zeros(1, 2, dtype=torch.long), seq_len, torch.Generator().manual_seed(0)
    )
    assert s_idx.tolist() == [[[BLOCK_SIZE], [BLOCK_SIZE]]]
    assert v_idx.tolist() == [[[seq_len], [seq_len]]]


def test_block_band_pattern_is_the_least_band_reaching_the_target(seed):
    batch, heads, seq_len = 2, 3, 16384
    num_blocks = seq_len // BLOCK_SIZE
    generator = torch.Generator().manual_seed(seed)
    total = seq_len * (seq_len + 1) // 2
    target = (torch.rand(batch, heads, generator=generator) * 0.2 * total).long() + total // 50
    v_idx, s_idx = flex_peer.block_band_pattern(target, seq_len)
    assert v_idx.tolist() == [[[seq_len]] * heads] * batch
    area = mask_area(v_idx, s_idx, seq_len)
    assert bool((area >= target).all())
    width = (s_idx < seq_len).sum(-1)
    for b in range(batch):
        for h in range(heads):
            w = int(width[b, h])
            assert s_idx[b, h, :w].tolist() == [d * BLOCK_SIZE for d in range(1, w + 1)]
            # one distance fewer falls short: the band is the least one
            assert int(area[b, h]) - (num_blocks - w) * BLOCK_SIZE**2 < int(target[b, h])


def test_block_band_pattern_refuses_a_single_block():
    with pytest.raises(ValueError, match="seq_len=128"):
        flex_peer.block_band_pattern(torch.zeros(1, 1, dtype=torch.long), 128)

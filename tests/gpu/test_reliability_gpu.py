"""Reliability cases that need CUDA (the CPU ones are tests/cpu/test_numerics_stress.py and
tests/distributed/test_no_hang.py).

* The Triton kernels on the GPU under extreme logits: bf16 inputs with logits up to ±1e4 and fp16 inputs
  whose q·kᵀ reaches 90 % of the fp16 maximum, with the index the (Triton) estimator picks under a
  forced-only, a top-P and a full budget; a W = 2 striped ring's steps against the fp64 reference.
  At ±1e4 bf16 logits dq and dk meet the FA rule but not always the 5e-3 relative RMSE of DESIGN.md §6: the
  kernels round P to bf16 before P·V (so out, and δ = rowsum(out ⊙ dO), carry it) and dS before dS·k and
  dSᵀ·q, as FlashAttention does, and where one key dominates a row dP − δ cancels. Those roundings alone, in
  fp64, move dq and dk by 3.8e-3 … 8.5e-3 on these inputs and the kernels by 0.77 … 1.58 times that, up to
  1.33e-2 (docs/benchmarks.md, session 55), so those two are bounded by twice that per-seed figure (at least
  §6's 5e-3); plain bf16 PyTorch attention is at 3 … 7 (300-700 %). Everything else keeps §6's.
* NaN/Inf in q or k reaches exactly the output rows that read it, a NaN in v the output, and every gradient.
* The ring's consensus over NCCL: one GPU with a different sequence length makes both ranks raise a
  ``ValueError`` within seconds (under a 20 s collective timeout), and the pair then runs a good call.
"""

import math
import time

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from patterns import random_index
from triton_cases import assert_close_fa, poisoned_attention, reference_attention, ring_attention

from mtraining_kernels import triton_backend
from mtraining_kernels.budget import StaticBudget, TopPBudget
from mtraining_kernels.estimation import estimate_vertical_slash
from mtraining_kernels.index import convert_index
from mtraining_kernels.layout import Layout
from mtraining_kernels.reference import vertical_slash_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEQ_LEN, HEADS, KV_HEADS, DIM = 2048, 4, 1, 128
SCALE = DIM**-0.5
NAMES = ("out", "lse", "dq", "dk", "dv")
BUDGETS = {
    "forced-only": StaticBudget(30, 100),
    "top-p": TopPBudget(0.9, cap=512),
    "full": StaticBudget(SEQ_LEN, SEQ_LEN),
}
STRESS = [
    pytest.param(torch.bfloat16, 1e4, id="bf16-1e4"),
    pytest.param(torch.float16, 0.9 * torch.finfo(torch.float16).max * SCALE, id="fp16-near-overflow"),
]


def _extreme_qkv_dout(largest_logit: float, dtype: torch.dtype, gen: torch.Generator):
    """q, k (CUDA) scaled together so the largest causal |logit| is ``largest_logit``; v, dout standard normal."""
    q = torch.randn(1, SEQ_LEN, HEADS, DIM, generator=gen, dtype=torch.float64).cuda()
    k = torch.randn(1, SEQ_LEN, KV_HEADS, DIM, generator=gen, dtype=torch.float64).cuda()
    logits = torch.einsum("bihd,bjd->bhij", q, k[:, :, 0]) * SCALE
    causal = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool, device="cuda").tril()
    factor = math.sqrt(largest_logit / logits.abs().masked_fill(~causal, 0).max().item())
    v, dout = (torch.randn(1, SEQ_LEN, heads, DIM, generator=gen).cuda() for heads in (KV_HEADS, HEADS))
    return (q * factor).to(dtype), (k * factor).to(dtype), v.to(dtype), dout.to(dtype)


@pytest.mark.parametrize("budget_name", list(BUDGETS))
@pytest.mark.parametrize("dtype, largest_logit", STRESS)
def test_triton_kernels_at_extreme_logits_match_reference(seed, dtype, largest_logit, budget_name):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = _extreme_qkv_dout(largest_logit, dtype, gen)
    index = estimate_vertical_slash(q, k, BUDGETS[budget_name])
    context = f"seed={seed} {dtype} budget={budget_name}"
    ours = ring_attention(triton_backend, q, k, v, dout, index.v_idx, index.s_idx, Layout("striped", 2))
    ref = reference_attention(q, k, v, dout, index.v_idx, index.s_idx, torch.float64)
    low = reference_attention(q, k, v, dout, index.v_idx, index.s_idx, dtype)
    # dq and dk at ±1e4 bf16 logits: §6's 5e-3, or twice what the kernels' bf16 roundings alone give on these inputs
    rounding = _bf16_rounding_rmse(q, k, v, dout, index, ref) if dtype == torch.bfloat16 else {}
    for name, a, r, lo in zip(NAMES, ours, ref, low):
        assert torch.isfinite(a).all(), f"{name} has non-finite entries ({context})"
        rmse_bound = max(5e-3, 2 * rounding.get(name, 0.0))
        assert_close_fa(name, a, r, lo, dtype, f"{context} rmse_bound={rmse_bound:.2e}", rmse_bound=rmse_bound)


def _bf16_rounding_rmse(q, k, v, dout, index, ref) -> dict[str, float]:
    """{"dq", "dk"}: the relative RMSE against ``ref`` (the fp64 reference's out, lse, dq, dk, dv) of dq and dk
    computed in fp64 with only the kernels' two bf16 roundings: P before P·V (so in out, and in δ = rowsum(out ⊙
    dout)) and dS = P ⊙ (dP − δ) before dS·k and dSᵀ·q. q, k, v, dout ``[1, N, H, d]``."""
    _, ref_lse, ref_dq, ref_dk, _ = ref
    dq = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float64, device=q.device)
    group = q.shape[2] // k.shape[2]
    for h in range(q.shape[2]):
        kv = h // group
        mask = vertical_slash_mask(index.v_idx[:, h : h + 1], index.s_idx[:, h : h + 1], SEQ_LEN)[0, 0]
        q_h, k_h, v_h, dout_h = (x[0, :, head].double() for x, head in ((q, h), (k, kv), (v, kv), (dout, h)))
        logits = (SCALE * q_h @ k_h.T).masked_fill(~mask, -math.inf)
        probs = torch.exp(logits - ref_lse[0, h, :, None].double())
        out = probs.to(torch.bfloat16).double() @ v_h
        delta = (out * dout_h).sum(-1, keepdim=True)
        dscores = (probs * (dout_h @ v_h.T - delta)).to(torch.bfloat16).double()
        dq[0, :, h] = SCALE * dscores @ k_h
        dk[0, :, kv] += SCALE * dscores.T @ q_h
    return {
        name: ((a - r.double()).norm() / r.double().norm()).item()
        for name, a, r in (("dq", dq, ref_dq), ("dk", dk, ref_dk))
    }


# ------------------------------------------------------------------------------------------ NCCL consensus
def _ring_call(rank: int, world_size: int, seed: int, local_len: int) -> None:
    from megatron_mtraining.ring.groups import RingGroups
    from megatron_mtraining.ring.sparse_ring import ring_attention as distributed_ring

    gen = torch.Generator().manual_seed(seed + rank)
    device = torch.device("cuda", rank)
    layout, seq_len = Layout("striped", world_size), local_len * world_size
    q = torch.randn(1, local_len, HEADS, DIM, generator=gen).to(device, torch.bfloat16).requires_grad_()
    k, v = (
        torch.randn(1, local_len, KV_HEADS, DIM, generator=gen).to(device, torch.bfloat16).requires_grad_()
        for _ in range(2)
    )
    v_idx, s_idx = random_index(1, HEADS, seq_len, 64, 16, gen)
    index = convert_index(v_idx.to(device), s_idx.to(device), layout, rank, seq_len)
    distributed_ring(q, k, v, index, RingGroups.flat(dist.group.WORLD), backend="triton").sum().backward()
    torch.cuda.synchronize(device)


def _inconsistent_then_good(rank: int, world_size: int, seed: int) -> dict:
    start = time.monotonic()
    try:
        _ring_call(rank, world_size, seed, local_len=2048 if rank == 1 else 1024)
        raised = None
    except ValueError as error:
        raised = str(error)
    seconds = time.monotonic() - start
    _ring_call(rank, world_size, seed, local_len=1024)
    return {"raised": raised, "seconds": seconds}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("poison", ["q nan", "k nan", "k inf", "v nan"])
def test_nan_or_inf_inputs_reach_the_outputs_that_read_them(seed, poison, dtype):
    """The Triton kernels on the GPU: a NaN/Inf in q or k makes exactly the output rows NaN that the fp64
    reference makes NaN (so Megatron's NaN check stops the step at the loss), and dq, dk, dv NaN. A NaN in v
    also reaches rows that give it weight 0 (0 · NaN = NaN): in the dense reference every row of the head, in
    the kernels the rows whose key tile holds it; so for v the check is that the output has NaN rows."""
    out, grads, ref_out, context = poisoned_attention(
        seed, poison, "triton", dtype, (SEQ_LEN, HEADS, KV_HEADS, DIM), device="cuda"
    )
    assert torch.isnan(ref_out).any(), f"the poison reaches nothing in the reference ({context})"
    if poison.startswith("v"):
        assert torch.isnan(out).any(), f"a {poison} vanished from the output ({context})"
    else:
        assert torch.equal(torch.isnan(out), torch.isnan(ref_out)), f"NaN outputs differ from the reference ({context})"
    for name, grad in zip("qkv", grads):
        assert torch.isnan(grad).any(), f"d{name} has no NaN, so the gradient check would miss it ({context})"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_ring_raises_on_every_rank_then_recovers(seed):
    outcomes = run_on_ranks(_inconsistent_then_good, 2, seed, backend="nccl", timeout=120, collective_timeout=20)
    for rank, outcome in enumerate(outcomes):
        assert outcome["raised"] is not None, f"rank {rank} did not raise on inconsistent input"
        assert "disagree" in outcome["raised"] and "N_loc" in outcome["raised"], outcome["raised"]
        assert outcome["seconds"] < 15, f"rank {rank} took {outcome['seconds']:.1f} s to raise"

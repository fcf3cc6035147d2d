"""Numerics under stress: extreme and all-equal logits, steps without work, tiny and full
budgets, NaN/Inf inputs.

Backends: ``torch_blocksparse`` with bf16 inputs (logits up to ±1e4) and, through Triton's CPU
interpreter, the Triton kernels with fp16 inputs whose q·kᵀ reaches 90 % of the fp16 maximum (tiny
shapes; the interpreter's bf16 dot products are wrong, see tests/cpu/test_triton_interpret.py, which
this module follows in skipping the Triton cases on machines with CUDA). Results are compared with
the fp64 masked reference by the DESIGN.md §6 rule (``triton_cases.assert_close_fa``).

Findings recorded here (docs/testing.md, "Reliability"):

* the kernels are accurate at ±1e4 logits, but the production autograd path computes
  delta = rowsum(dout ⊙ out) from the bf16-rounded output, as FlashAttention does, so its dq/dk are
  within the §6 rule of FlashAttention's gradients, not of the exact ones, at such logits;
* NaN/Inf in q, k or v: the estimator does not detect it (it returns a valid index); both backends give
  exactly the rows whose logits (or values) hold NaN/Inf a NaN output, as the reference does, and the
  gradients become NaN, so Megatron's --check-for-nan-in-loss-and-grad stops the step at the loss.
"""

import importlib
import math
import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' @triton.jit
TRITON_CASES_RUN = os.environ.get("TRITON_INTERPRET") == "1"

from triton_cases import (
    assert_close_fa,
    make_index,
    poisoned_attention,
    reference_attention,
    ring_attention,
)

from mtraining_kernels import torch_backend
from mtraining_kernels.budget import StaticBudget, TopPBudget
from mtraining_kernels.estimation import estimate_vertical_slash
from mtraining_kernels.index import convert_index
from mtraining_kernels.interface import sparse_attention
from mtraining_kernels.layout import Layout
from mtraining_kernels.reference import reference_sparse_attention, vertical_slash_mask

NAMES = ("out", "lse", "dq", "dk", "dv")
SEQ_LEN, HEADS, KV_HEADS, DIM = 512, 2, 1, 64
SCALE = DIM**-0.5
FP16_NEAR_OVERFLOW = 0.9 * torch.finfo(torch.float16).max  # largest |q·kᵀ| of the fp16 cases


def _backend(name: str):
    """The step launchers of ``name``; the Triton ones rebuilt for the interpreter if imported without it."""
    if name == "torch_blocksparse":
        return torch_backend
    from mtraining_kernels import triton_backend, triton_bwd, triton_fwd

    if type(triton_fwd.block_bar_forward_kernel).__name__ != "InterpretedFunction":
        for module in (triton_fwd, triton_bwd, triton_backend):
            importlib.reload(module)
    return triton_backend


# (backend, input dtype, largest |logit|): bf16 at ±1e4; fp16 with q·kᵀ near the fp16 maximum
STRESS = [
    pytest.param("torch_blocksparse", torch.bfloat16, 1e4, id="torch-bf16-1e4"),
    pytest.param(
        "triton",
        torch.float16,
        FP16_NEAR_OVERFLOW * SCALE,
        id="triton-fp16-near-overflow",
        marks=pytest.mark.skipif(not TRITON_CASES_RUN, reason="Triton interpreter cases run without CUDA"),
    ),
]


# ------------------------------------------------------------------------------------------ inputs
def _visible_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 logits ``[b, Hq, N, N]`` of the pairs the mask (default: causal) shows, 0 elsewhere."""
    kf = k.double().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    logits = torch.einsum("bihd,bjhd->bhij", q.double(), kf) * SCALE
    visible = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril() if mask is None else mask
    return torch.where(visible, logits, 0.0)


def _extreme_qkv_dout(largest_logit: float, dtype: torch.dtype, gen: torch.Generator):
    """q, k scaled together so the largest causal |logit| is ``largest_logit``; v, dout standard normal."""
    q = torch.randn(1, SEQ_LEN, HEADS, DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(1, SEQ_LEN, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    factor = math.sqrt(largest_logit / _visible_logits(q, k).abs().max().item())
    v = torch.randn(1, SEQ_LEN, KV_HEADS, DIM, generator=gen)
    dout = torch.randn(1, SEQ_LEN, HEADS, DIM, generator=gen)
    return (q * factor).to(dtype), (k * factor).to(dtype), v.to(dtype), dout.to(dtype)


BUDGETS = {
    "forced-only": StaticBudget(30, 100),  # the 30 sinks and offsets 0 … 99, nothing else
    "top-p": TopPBudget(0.9, cap=256),
    "full": StaticBudget(SEQ_LEN, SEQ_LEN),  # every column and offset: the causal triangle
}


def _check_budget_extremes(name: str, v_idx: torch.Tensor, s_idx: torch.Tensor, context: str) -> None:
    """The tiny budget selects exactly the forced entries; the full one selects everything."""
    if name == "forced-only":
        expected_v, expected_s = torch.arange(30), torch.arange(100)
    elif name == "full":
        expected_v = expected_s = torch.arange(SEQ_LEN)
    else:
        return
    for what, idx, expected in (("v_idx", v_idx, expected_v), ("s_idx", s_idx, expected_s)):
        for row in idx.reshape(-1, idx.shape[-1]):
            assert torch.equal(row[row < SEQ_LEN].long(), expected), f"{name} budget: {what} row {row} ({context})"


# ------------------------------------------------------------------------------------------ extreme logits
@pytest.mark.parametrize("budget_name", list(BUDGETS))
@pytest.mark.parametrize("backend_name, dtype, largest_logit", STRESS)
def test_extreme_logits_match_reference(seed, backend_name, dtype, largest_logit, budget_name):
    """The estimator's index for stressed q/k, then a W = 2 striped ring's step launchers (fp32 out and delta)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = _extreme_qkv_dout(largest_logit, dtype, gen)
    index = estimate_vertical_slash(q, k, BUDGETS[budget_name])
    context = f"seed={seed} {backend_name} {dtype} budget={budget_name}"
    _check_budget_extremes(budget_name, index.v_idx, index.s_idx, context)
    mask = vertical_slash_mask(index.v_idx, index.s_idx, SEQ_LEN)
    reached = _visible_logits(q, k, mask).abs().max().item()
    assert reached >= 0.5 * largest_logit, f"the stress is not reached: max |visible logit| {reached:.3g} ({context})"

    ours = ring_attention(_backend(backend_name), q, k, v, dout, index.v_idx, index.s_idx, Layout("striped", 2))
    ref = reference_attention(q, k, v, dout, index.v_idx, index.s_idx, torch.float64)
    low = reference_attention(q, k, v, dout, index.v_idx, index.s_idx, dtype)
    for name, a, r, lo in zip(NAMES, ours, ref, low):
        assert torch.isfinite(a).all(), f"{name} has non-finite entries ({context})"
        assert_close_fa(name, a, r, lo, dtype, context)


def _flash_style_gradients(q, k, v, dout, out, v_idx, s_idx) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 dq, dk with dS = P ⊙ (dP − delta), where delta = rowsum(dout ⊙ out) comes from ``out`` (the output
    the backward saw) rather than from the exact output: FlashAttention's definition of the backward.

    Since ∂lse_i/∂s_ij = P_ij, subtracting Σ_i shift_i·lse_i (shift = delta − exact delta, held constant)
    from Σ out ⊙ dout turns the exact dS into exactly that.
    """
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    exact_out, lse = reference_sparse_attention(*leaves, vertical_slash_mask(v_idx, s_idx, SEQ_LEN))
    shift = (dout.double() * (out.double() - exact_out.detach())).sum(-1).transpose(1, 2)  # [b, Hq, N]
    objective = (exact_out * dout.double()).sum() - (shift * lse).sum()
    return torch.autograd.grad(objective, leaves[:2])


def test_production_path_at_extreme_logits(seed):
    """sparse_attention on bf16 inputs with logits up to ±1e4 (bf16 out, delta from it, bf16 gradients).

    out, lse and dv meet the §6 rule against the exact fp64 reference. dq and dk meet it against the
    FlashAttention-style fp64 gradients (delta from the bf16 output): against the exact ones their
    relative RMSE is 4e-3 … 4e-2 at these logits (docs/testing.md), which is that delta's rounding.
    """
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = _extreme_qkv_dout(1e4, torch.bfloat16, gen)
    v_idx, s_idx = make_index(1, HEADS, SEQ_LEN, "mixed", gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = sparse_attention(
        *leaves,
        convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, SEQ_LEN),
        backend="torch_blocksparse",
        return_lse=True,
    )
    out.backward(dout)
    ours = (out.detach(), lse, *(leaf.grad for leaf in leaves))
    ref = list(reference_attention(q, k, v, dout, v_idx, s_idx, torch.float64))
    low = reference_attention(q, k, v, dout, v_idx, s_idx, torch.bfloat16)
    ref[2:4] = _flash_style_gradients(q, k, v, dout, out.detach(), v_idx, s_idx)
    context = f"seed={seed} sparse_attention bf16 logits 1e4"
    for name, a, r, lo in zip(NAMES, ours, ref, low):
        assert torch.isfinite(a).all(), f"{name} has non-finite entries ({context})"
        assert_close_fa(name, a, r, lo, torch.bfloat16, context)


# ------------------------------------------------------------------------------------------ all-equal logits
@pytest.mark.parametrize("sign", [0, 1, -1], ids=["zero", "positive", "negative"])
@pytest.mark.parametrize("backend_name, dtype, largest_logit", STRESS)
def test_all_equal_logits_give_uniform_attention(seed, backend_name, dtype, largest_logit, sign):
    """q = a·e0 and k = b·e0 + (random in the other dims): every visible logit equals a·b·scale exactly,
    0 or ±1e4 (bf16; fp16: ±7.2e3, q·kᵀ = ±57600).

    The output must be the mean of the visible values and lse = logit + log(#visible), besides the §6 rule.
    (b is kept small: a large component shared by every key multiplies the rounding of Σ_j dS_ij, which
    is 0 exactly, into dq; see docs/testing.md.)
    """
    gen = torch.Generator().manual_seed(seed)
    q_first, k_first = sign * (3200.0 if dtype == torch.bfloat16 else 2304.0), 25.0  # exact in bf16/fp16
    logit = q_first * k_first * SCALE
    assert abs(logit) <= largest_logit
    q = torch.zeros(1, SEQ_LEN, HEADS, DIM)
    q[..., 0] = q_first
    k = torch.randn(1, SEQ_LEN, KV_HEADS, DIM, generator=gen)
    k[..., 0] = k_first
    v = torch.randn(1, SEQ_LEN, KV_HEADS, DIM, generator=gen)
    dout = torch.randn(1, SEQ_LEN, HEADS, DIM, generator=gen)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    v_idx, s_idx = make_index(1, HEADS, SEQ_LEN, "mixed", gen)
    context = f"seed={seed} {backend_name} {dtype} all logits = {logit}"

    ours = ring_attention(_backend(backend_name), q, k, v, dout, v_idx, s_idx, Layout("zigzag", 2))
    ref = reference_attention(q, k, v, dout, v_idx, s_idx, torch.float64)
    low = reference_attention(q, k, v, dout, v_idx, s_idx, dtype)
    for name, a, r, lo in zip(NAMES, ours, ref, low):
        assert_close_fa(name, a, r, lo, dtype, context)

    mask = vertical_slash_mask(v_idx, s_idx, SEQ_LEN)  # [1, Hq, N, N]
    visible = mask.sum(-1).double()
    expected_lse = logit + torch.log(visible)
    lse_error = (ours[1].double() - expected_lse).abs().max().item()
    assert lse_error <= 4 * torch.finfo(torch.float32).eps * max(abs(logit), 1.0) + 1e-5, (
        f"lse differs from logit + log(#visible) by {lse_error:.3e} ({context})"
    )
    mean_v = (mask.double() @ v.double()[0, :, 0]) / visible[..., None]  # [1, Hq, N, d]
    out_error = (ours[0].double() - mean_v.transpose(1, 2)).abs().max().item()
    assert out_error <= 1e-3, f"out differs from the mean of the visible values by {out_error:.3e} ({context})"


# ------------------------------------------------------------------------------------------ steps without work
def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of an fp32 tensor, so that NaN entries compare equal to themselves."""
    return t.view(torch.int32)


@pytest.mark.parametrize("backend_name, dtype, largest_logit", STRESS)
def test_steps_without_work_leave_state_untouched(seed, backend_name, dtype, largest_logit):
    """Rank 1 of a contiguous W = 2 split, step reading source 0 (off the diagonal).

    Head 0 has a slash and a vertical reaching source 0, head 1 has nothing: head 1's rows of out/lse/dq
    keep their bits (NaN and −inf included), head 0's become finite even where the running state was
    "nothing yet" (lse = −inf, out = NaN). A second index reaches nothing of source 0 at all: the step
    must leave every buffer bit-identical, forward and backward.
    """
    backend = _backend(backend_name)
    gen = torch.Generator().manual_seed(seed)
    layout, local_len = Layout("contiguous", 2), SEQ_LEN // 2
    q, k, v, dout = _extreme_qkv_dout(largest_logit, dtype, gen)
    q, dout = (t[:, local_len:].contiguous() for t in (q, dout))  # rank 1's queries
    k, v = (t[:, :local_len].contiguous() for t in (k, v))  # source 0's keys
    partial = convert_index(
        torch.tensor([[[10], [SEQ_LEN]]], dtype=torch.int32),
        torch.tensor([[[300], [SEQ_LEN]]], dtype=torch.int32),
        layout,
        1,
        SEQ_LEN,
    )
    nothing = convert_index(
        torch.full((1, HEADS, 1), SEQ_LEN, dtype=torch.int32),
        torch.zeros(1, HEADS, 1, dtype=torch.int32),
        layout,
        1,
        SEQ_LEN,
    )
    assert all(ptr[0].max() == ptr[0].min() for ptr in (nothing.blk_ptr, nothing.bar_ptr)), "step 0 has work"

    idle = torch.zeros(1, HEADS, local_len, dtype=torch.bool)
    idle[:, 1] = True
    empty = torch.rand(idle.shape, generator=gen) < 0.5  # "nothing yet" rows
    out = torch.randn(q.shape, generator=gen)
    lse = torch.randn(idle.shape, generator=gen) * 10
    lse[empty] = float("-inf")
    out[empty.transpose(1, 2)] = float("nan")
    context = f"seed={seed} {backend_name} {dtype}"

    for name, index in (("no work at all", nothing), ("head 1 idle", partial)):
        out_before, lse_before = out.clone(), lse.clone()
        backend.block_bar_forward(
            q,
            k,
            v,
            index.blk_ptr[0],
            index.blk_col,
            index.bar_ptr[0],
            index.bar_col,
            out,
            lse,
            causal_diag=False,
            softmax_scale=SCALE,
        )
        untouched = torch.ones_like(idle) if index is nothing else idle
        assert torch.equal(_bits(lse[untouched]), _bits(lse_before[untouched])), f"{name}: lse changed ({context})"
        assert torch.equal(_bits(out[untouched.transpose(1, 2)]), _bits(out_before[untouched.transpose(1, 2)])), (
            f"{name}: out changed ({context})"
        )
    active = ~idle
    assert torch.isfinite(lse[active]).all() and torch.isfinite(out[active.transpose(1, 2)]).all(), (
        f"head 0 rows are not finite after their step ({context})"
    )

    lse_final = torch.where(torch.isfinite(lse), lse, 0.0)  # a finished row always has a finite lse
    delta = torch.randn(lse.shape, generator=gen)
    dq, dk, dv = (torch.randn(shape, generator=gen) for shape in (q.shape, k.shape, v.shape))
    for name, index in (("no work at all", nothing), ("head 1 idle", partial)):
        before = [t.clone() for t in (dq, dk, dv)]
        backend.block_bar_backward(
            q,
            k,
            v,
            dout,
            lse_final,
            delta,
            index.blk_ptr[0],
            index.blk_col,
            index.bar_ptr[0],
            index.bar_col,
            dq,
            dk,
            dv,
            causal_diag=False,
            softmax_scale=SCALE,
        )
        if index is nothing:
            for grad_name, now, then in zip(("dq", "dk", "dv"), (dq, dk, dv), before):
                assert torch.equal(_bits(now), _bits(then)), f"{name}: {grad_name} changed ({context})"
        else:
            idle_rows = idle.transpose(1, 2)
            assert torch.equal(_bits(dq[idle_rows]), _bits(before[0][idle_rows])), f"idle dq rows changed ({context})"
    for grad_name, grad in zip(("dq", "dk", "dv"), (dq, dk, dv)):
        assert torch.isfinite(grad).all(), f"{grad_name} is not finite ({context})"


# ------------------------------------------------------------------------------------------ NaN and Inf
@pytest.mark.parametrize("budget", [StaticBudget(64, 128), TopPBudget(0.9, cap=256)], ids=["static", "top-p"])
@pytest.mark.parametrize("where", ["estimation query", "key column"])
def test_estimator_turns_nan_inputs_into_a_valid_index(seed, budget, where):
    """Documented behaviour: the estimator does not detect NaN (that would need a host sync and a collective
    to stay safe on every rank); it returns an index that converts, with the forced entries in it."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, SEQ_LEN, HEADS, DIM, generator=gen)
    k = torch.randn(1, SEQ_LEN, KV_HEADS, DIM, generator=gen)
    row = int(torch.randint(SEQ_LEN - 64, SEQ_LEN, (1,), generator=gen))
    column = int(torch.randint(0, SEQ_LEN - 64, (1,), generator=gen))
    if where == "estimation query":
        q[0, row, 0, 0] = float("nan")
    else:
        k[0, column, 0, 0] = float("nan")
    index = estimate_vertical_slash(q, k, budget)
    convert_index(index.v_idx, index.s_idx, Layout("striped", 1), 0, SEQ_LEN)  # raises on an invalid index
    for name, idx, forced in (("v_idx", index.v_idx, 30), ("s_idx", index.s_idx, 100)):
        assert (idx[..., :forced] == torch.arange(forced, dtype=torch.int32)).all(), (
            f"{name} lost its forced entries with NaN in the {where} (seed={seed})"
        )


POISONS = ["q nan", "k nan", "k inf", "v nan"]
BACKENDS = [
    pytest.param("torch_blocksparse", torch.float32, id="torch-fp32"),
    pytest.param("triton", torch.float16, id="triton-fp16", marks=STRESS[1].marks),
]


@pytest.mark.parametrize("backend_name, dtype", BACKENDS)
@pytest.mark.parametrize("poison", POISONS)
def test_nan_or_inf_inputs_reach_the_loss_or_the_gradients(seed, poison, backend_name, dtype):
    """What Megatron's --check-for-nan-in-loss-and-grad (on by default) sees: a NaN/Inf in q, k or v makes the
    outputs that read it NaN (caught at the loss) and dq, dk and dv NaN (caught at the gradient norm, before
    the optimizer step)."""
    out, grads, _, context = poisoned_attention(seed, poison, backend_name, dtype, (SEQ_LEN, HEADS, KV_HEADS, DIM))
    assert torch.isnan(out).any(), f"a {poison} vanished from the output ({context})"
    for name, grad in zip("qkv", grads):
        assert torch.isnan(grad).any(), f"d{name} has no NaN, so the gradient check would miss it ({context})"


@pytest.mark.parametrize("backend_name, dtype", BACKENDS)
@pytest.mark.parametrize("poison", POISONS[:3])
def test_nan_or_inf_in_q_k_reach_exactly_the_outputs_that_read_them(seed, poison, backend_name, dtype):
    out, _, ref_out, context = poisoned_attention(seed, poison, backend_name, dtype, (SEQ_LEN, HEADS, KV_HEADS, DIM))
    assert torch.isnan(ref_out).any(), f"the poison reaches nothing in the reference ({context})"
    assert torch.equal(torch.isnan(out), torch.isnan(ref_out)), f"NaN outputs differ from the reference ({context})"


def test_megatron_loss_check_stops_on_nan(monkeypatch):
    """The launcher's loss function raises on a NaN loss when --check-for-nan-in-loss-and-grad is on
    (Megatron's default) and passes it through when it is off."""
    from megatron.core.rerun_state_machine import RerunStateMachine
    from megatron_cpu import megatron_on_cpu

    import megatron_mtraining.pretrain as pretrain

    losses = torch.ones(2, 8)
    losses[1, 3] = float("nan")  # one token's loss, e.g. from a NaN attention output
    loss_mask = torch.ones(2, 8)
    monkeypatch.setattr(pretrain, "get_rerun_state_machine", lambda: RerunStateMachine())
    with megatron_on_cpu():
        monkeypatch.setattr(
            pretrain,
            "get_args",
            lambda: SimpleNamespace(check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=False),
        )
        with pytest.raises(RuntimeError, match="found NaN in local forward loss calculation"):
            pretrain.loss_func(loss_mask, losses)
        monkeypatch.setattr(
            pretrain,
            "get_args",
            lambda: SimpleNamespace(check_for_nan_in_loss_and_grad=False, check_for_spiky_loss=False),
        )
        loss, _, _ = pretrain.loss_func(loss_mask, losses)
    assert torch.isnan(loss), "with the check off the NaN loss is passed on"

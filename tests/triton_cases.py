"""Shared checks for the Triton backend tests (CPU interpreter and GPU).

* :func:`make_index` — random (v_idx, s_idx) of a named pattern kind;
* :func:`ring_attention` — a whole flat ring simulated on one device with a backend's step launchers
  (every rank's forward steps, then every backward step), returned in global token order;
  :func:`packed_ring_attention` the same for packed documents;
* :func:`reference_attention` — fp32/fp64 (or low-precision) masked reference with autograd
  gradients, one query head at a time so that long sequences fit in memory;
  :func:`packed_reference_attention` the same on the packed documents' mask;
* :func:`assert_close_fa` — DESIGN.md §6: max|ours − ref| ≤ 2·max|lowprec − ref| + ε and relative RMSE;
* :func:`poisoned_attention` — ``sparse_attention`` forward + backward with one NaN/Inf in q, k or v;
* :func:`off_alignment` — a copy whose address is not a 16-byte multiple (the kernels' pointer-gather path);
* :func:`single_device_attention` — ``sparse_attention`` forward + backward on one device.
"""

from __future__ import annotations

import torch
from patterns import random_index

from mtraining_kernels.document_conversion import convert_document_index
from mtraining_kernels.document_index import DocumentIndex
from mtraining_kernels.index import convert_index
from mtraining_kernels.interface import sparse_attention
from mtraining_kernels.layout import Layout
from mtraining_kernels.reference import packed_vertical_slash_mask, reference_sparse_attention, vertical_slash_mask
from mtraining_kernels.vertical_slash import full_index

PATTERNS = ("mixed", "bars", "verticals", "slashes", "full")


def make_index(batch: int, heads: int, seq_len: int, pattern: str, generator: torch.Generator):
    """(v_idx, s_idx) int32 ``[b, Hq, ·]``: ``mixed`` has the forced sinks/window plus random entries;
    ``bars`` few slashes and many verticals (most verticals become bars); ``verticals`` / ``slashes``
    only that kind (plus the always-on diagonal block); ``full`` the whole causal triangle."""
    if pattern == "full":
        return full_index(batch, heads, seq_len)
    nothing = torch.full((batch, heads, 1), seq_len, dtype=torch.int32)
    if pattern == "mixed":
        return random_index(batch, heads, seq_len, seq_len // 16, seq_len // 64, generator, forced=True)
    v_idx, s_idx = random_index(batch, heads, seq_len, seq_len // 8, 3, generator, forced=False)
    if pattern == "bars":
        return v_idx, s_idx
    if pattern == "verticals":
        return v_idx, nothing
    if pattern == "slashes":
        return nothing, s_idx
    raise ValueError(f"pattern {pattern!r} is not one of {PATTERNS}")


# triton_backend's short-list limits that force each route of the default backward: never short, always short
LIST_ROUTES = {"long_lists": 0, "short_lists": 10**9}


def force_list_route(monkeypatch, route: str) -> None:
    """Make the Triton backend's default backward take ``route`` (a key of :data:`LIST_ROUTES`) whatever the lists'
    length, with bars or without (DESIGN.md §2.6)."""
    from mtraining_kernels import triton_backend  # here: the modules without Triton import this one too

    for name in ("SHORT_LISTS", "SHORT_LISTS_WITH_BARS"):
        monkeypatch.setattr(triton_backend, name, LIST_ROUTES[route])


def make_qkv_dout(batch, seq_len, heads, kv_heads, dim, dtype, device, generator):
    def draw(h):
        return torch.randn(batch, seq_len, h, dim, generator=generator).to(device=device, dtype=dtype)

    return draw(heads), draw(kv_heads), draw(kv_heads), draw(heads)


def off_alignment(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` starting one element past a 16-byte boundary, so the Triton backend reads
    its tiles by pointer gathers rather than tensor-memory copies."""
    storage = torch.empty(t.numel() + 16, dtype=t.dtype, device=t.device)
    start = next(i for i in range(1, 16) if (storage.data_ptr() + i * t.element_size()) % 16)
    copy = storage[start : start + t.numel()].view(t.shape)
    copy.copy_(t)
    return copy


def single_device_attention(q, k, v, dout, index, *, deterministic: bool = False):
    """(out, dq, dk, dv) of the Triton backend's ``sparse_attention`` on q, k, v as given (their storage kept)."""
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    out = sparse_attention(*inputs, index, backend="triton", deterministic=deterministic)
    return (out, *torch.autograd.grad(out, inputs, dout))


def ring_attention(backend, q, k, v, dout, v_idx, s_idx, layout: Layout, *, deterministic: bool = False):
    """Run a W-rank flat ring's steps on one device; return out, lse, dq, dk, dv (fp32, global order).

    Rank r's step t reads source w = (r − t) mod W with the causal mask only at w == r. The running
    output starts as NaN (lse = −inf must make the backend ignore it).
    """
    seq_len, device = q.shape[1], q.device
    indices = [convert_index(v_idx.to(device), s_idx.to(device), layout, r, seq_len) for r in range(layout.world_size)]
    return _run_ring(backend, q, k, v, dout, indices, layout, deterministic)


def packed_ring_attention(backend, q, k, v, dout, index: DocumentIndex, layout: Layout, *, deterministic=False):
    """:func:`ring_attention` of packed documents: every rank's lists from ``convert_document_index``, the
    steps' document ids from the index."""
    indices = [convert_document_index(index, layout, r) for r in range(layout.world_size)]
    return _run_ring(backend, q, k, v, dout, indices, layout, deterministic)


def _run_ring(backend, q, k, v, dout, indices, layout: Layout, deterministic: bool):
    """The steps of :func:`ring_attention` with rank r's lists ``indices[r]``."""
    world = layout.world_size
    scale = q.shape[-1] ** -0.5
    device = q.device
    qs, ks, vs, douts = ([layout.shard(x, r) for r in range(world)] for x in (q, k, v, dout))
    outs, lses = [], []
    for r in range(world):
        out = torch.full(qs[r].shape, float("nan"), dtype=torch.float32, device=device)
        lse = torch.full((q.shape[0], q.shape[2], qs[r].shape[1]), float("-inf"), device=device)
        for step in range(world):
            w, idx = (r - step) % world, indices[r]
            backend.block_bar_forward(
                qs[r],
                ks[w],
                vs[w],
                idx.blk_ptr[w],
                idx.blk_col,
                idx.bar_ptr[w],
                idx.bar_col,
                out,
                lse,
                causal_diag=(w == r),
                softmax_scale=scale,
                **idx.step_doc_ids(w),
            )
        outs.append(out)
        lses.append(lse)
    dqs = [torch.zeros(x.shape, dtype=torch.float32, device=device) for x in qs]
    dks = [torch.zeros(x.shape, dtype=torch.float32, device=device) for x in ks]
    dvs = [torch.zeros(x.shape, dtype=torch.float32, device=device) for x in vs]
    for r in range(world):
        delta = (outs[r] * douts[r].float()).sum(-1).transpose(1, 2).contiguous()
        for step in range(world):
            w, idx = (r - step) % world, indices[r]
            backend.block_bar_backward(
                qs[r],
                ks[w],
                vs[w],
                douts[r],
                lses[r],
                delta,
                idx.blk_ptr[w],
                idx.blk_col,
                idx.bar_ptr[w],
                idx.bar_col,
                dqs[r],
                dks[w],
                dvs[w],
                causal_diag=(w == r),
                softmax_scale=scale,
                deterministic=deterministic,
                key_lists=idx.key_lists(w),  # as the ring passes them: the lists of all W steps
                **idx.step_doc_ids(w),
            )
    lse = layout.unshard([x.transpose(1, 2) for x in lses]).transpose(1, 2)
    return (layout.unshard(outs), lse, layout.unshard(dqs), layout.unshard(dks), layout.unshard(dvs))


def reference_attention(q, k, v, dout, v_idx, s_idx, compute_dtype: torch.dtype):
    """Masked reference out, lse, dq, dk, dv in ``compute_dtype`` (autograd), one query head at a time."""
    seq_len = q.shape[1]

    def head_mask(h: int) -> torch.Tensor:
        return vertical_slash_mask(v_idx[:, h : h + 1].to(q.device), s_idx[:, h : h + 1].to(q.device), seq_len)

    return _reference_by_head(q, k, v, dout, head_mask, compute_dtype)


def packed_reference_attention(q, k, v, dout, index: DocumentIndex, compute_dtype: torch.dtype):
    """:func:`reference_attention` on the packed documents' mask (``packed_vertical_slash_mask``)."""
    mask = packed_vertical_slash_mask(index).to(q.device)
    return _reference_by_head(q, k, v, dout, lambda h: mask[:, h : h + 1], compute_dtype)


def _reference_by_head(q, k, v, dout, head_mask, compute_dtype: torch.dtype):
    """The reference of every query head h under ``head_mask(h)`` bool ``[b, 1, N, N]``."""
    batch, seq_len, heads, _ = q.shape
    group = heads // k.shape[2]
    out = torch.empty(q.shape, dtype=compute_dtype, device=q.device)
    lse = torch.empty(batch, heads, seq_len, dtype=compute_dtype, device=q.device)
    dq = torch.empty_like(out)
    dk = torch.zeros(k.shape, dtype=compute_dtype, device=q.device)
    dv = torch.zeros_like(dk)
    for h in range(heads):
        kv = h // group
        mask = head_mask(h)
        leaves = [
            x.detach().to(compute_dtype).requires_grad_()
            for x in (q[:, :, h : h + 1], k[:, :, kv : kv + 1], v[:, :, kv : kv + 1])
        ]
        head_out, head_lse = reference_sparse_attention(*leaves, mask, compute_dtype=compute_dtype)
        grads = torch.autograd.grad(head_out, leaves, dout[:, :, h : h + 1].to(compute_dtype))
        out[:, :, h : h + 1] = head_out.detach()
        lse[:, h : h + 1] = head_lse.detach()
        dq[:, :, h : h + 1] = grads[0]
        dk[:, :, kv : kv + 1] += grads[1]
        dv[:, :, kv : kv + 1] += grads[2]
        del mask, head_out, head_lse, grads, leaves
    return out, lse, dq, dk, dv


def assert_close_fa(
    name: str,
    ours: torch.Tensor,
    ref: torch.Tensor,
    lowprec: torch.Tensor,
    input_dtype: torch.dtype,
    context: str,
    rmse_bound: float = 5e-3,
) -> None:
    """DESIGN.md §6 FA rule plus relative RMSE < ``rmse_bound`` (§6: 5e-3); NaN never passes."""
    ours, ref, lowprec = ours.double(), ref.double(), lowprec.double()
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ours), finite), (
        f"{name}: non-finite entries differ from the reference ({context})"
    )
    ours, ref, lowprec = ours[finite], ref[finite], lowprec[finite]
    if ref.numel() == 0:
        return
    error = (ours - ref).abs().max().item()
    baseline = (lowprec - ref).abs().max().item()
    epsilon = torch.finfo(input_dtype).eps * ref.abs().max().item()
    assert error <= 2 * baseline + epsilon, (
        f"{name}: max error {error:.3e} > 2 x low-precision error {baseline:.3e} + eps {epsilon:.3e} ({context})"
    )
    rmse = ((ours - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert rmse < rmse_bound, f"{name}: relative RMSE {rmse:.3e} >= {rmse_bound:g} ({context})"


def poisoned_attention(
    seed: int, poison: str, backend_name: str, dtype: torch.dtype, shape: tuple[int, int, int, int], device: str = "cpu"
):
    """(out, [dq, dk, dv], fp64 reference out, context) of ``sparse_attention`` on a ``mixed`` pattern with
    one ``poison`` ("q nan", "k nan", "k inf" or "v nan") at a random position; ``shape`` = (N, Hq, Hkv, d).
    Results and the reference come back on the CPU."""
    seq_len, heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq_len, heads, dim, generator=gen)
    k, v = (torch.randn(1, seq_len, kv_heads, dim, generator=gen) for _ in range(2))
    v_idx, s_idx = make_index(1, heads, seq_len, "mixed", gen)
    position = int(torch.randint(0, seq_len, (1,), generator=gen))
    tensor = {"q": q, "k": k, "v": v}[poison[0]]
    # +Inf where the last query head at the same position gets a +Inf logit (a −Inf logit only hides the key)
    tensor[0, position, -1, 0] = float("inf") * q[0, position, -1, 0].sign() if poison.endswith("inf") else float("nan")
    leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    index = convert_index(v_idx.to(device), s_idx.to(device), Layout("contiguous", 1), 0, seq_len)
    out = sparse_attention(*leaves, index, backend=backend_name)
    out.float().square().sum().backward()
    ref_out, _ = reference_sparse_attention(
        *(t.double() for t in (q, k, v)), vertical_slash_mask(v_idx, s_idx, seq_len)
    )
    context = f"seed={seed} {backend_name} {dtype} {poison} at position {position} on {device}"
    return out.detach().cpu(), [leaf.grad.cpu() for leaf in leaves], ref_out, context

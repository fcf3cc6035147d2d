"""Shared check of ``replay_output`` (activation recomputation that keeps the attention output)."""

from __future__ import annotations

from typing import Callable

import torch


def _forward_backward(attention: Callable, inputs, dout: torch.Tensor, replay_output) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in inputs]
    out, lse = attention(*leaves, replay_output)
    out.backward(dout)
    return [out.detach(), lse] + [leaf.grad for leaf in leaves]


def replay_matches(attention: Callable, inputs, dout: torch.Tensor, module, launcher: str) -> bool:
    """``attention(q, k, v, replay_output)`` returns (out, lse). True when replaying the plain call's
    (out, lse), with ``module.<launcher>`` (the forward launch) removed so that a forward would fail, gives
    bitwise the same out, lse, dq, dk and dv as the plain call."""
    plain = _forward_backward(attention, inputs, dout, None)
    launch = getattr(module, launcher)
    setattr(module, launcher, None)
    try:
        replayed = _forward_backward(attention, inputs, dout, (plain[0].clone(), plain[1].clone()))
    finally:
        setattr(module, launcher, launch)
    return all(torch.equal(a, b) for a, b in zip(plain, replayed, strict=True))

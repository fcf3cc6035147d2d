"""Repeat launches of a Triton kernel without the JIT's per-call binding and specialisation.

``kernel[grid](*args, **constexprs)`` binds the arguments, specialises each one (dtype, 16-byte alignment, an
integer's divisibility by 16 or equality to 1), builds a cache key from them and only then calls the compiled
kernel's launcher, on every call (docs/benchmarks.md, sessions 47 and 50, measure its share of a step's host time).
:class:`DirectLaunch` keys its own cache on what those specialisations are functions of (each tensor's dtype and
alignment, each integer's value, each tensor descriptor's dtype, tile and layout), the constexprs and the launch
options, and calls the cached kernel's launcher itself; a call with a new key goes through ``kernel[grid]`` once
and caches the kernel that compiles or finds. It passes each CUDA tensor as its address, which the launcher takes
as given; given the tensor, the launcher would call its ``data_ptr`` and ask the driver whether that address is a
device one (``cuPointerGetAttribute``), on every launch. A CPU tensor is passed as itself, so the launcher still
refuses it.

The launcher's calling convention is Triton's internal one, so the direct path runs only on the release of
:data:`DIRECT_TRITON` (the Gluon kernels' too, ``triton_backend.ONE_PASS_TRITON``), outside the interpreter and
without launch or pre-run hooks (a profiler's, a test's); otherwise, and for an argument of a kind it does not key,
the call goes through ``kernel[grid]``.
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
from triton import knobs
from triton.runtime import driver

DIRECT_TRITON = "3.6."  # the release whose launcher convention this module calls (``JITFunction.run``'s)


def _descriptor_key(d) -> tuple:
    return d.base.dtype, tuple(d.block_shape), getattr(d, "layout", None), d.padding  # Triton's own: no layout


def _argument_key(arg):
    """What Triton's specialisation of ``arg`` is a function of: an integer's value (1, divisible by 16, its
    width), a bool's value (not specialised, distinct from 0 and 1), a tensor's dtype and 16-byte alignment, a
    host tensor descriptor's dtype, tile and layout (its pointer, shape and strides are launch arguments)."""
    kind = type(arg)
    if kind is int:
        return arg
    if kind is torch.Tensor or isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if kind is bool:
        return "u1", arg
    if kind is float:
        return float
    if arg is None:
        return None
    if hasattr(arg, "block_shape") and hasattr(arg, "base"):
        return _descriptor_key(arg)
    raise TypeError(f"DirectLaunch takes tensors, tensor descriptors, ints, floats, bools and None, got {kind}")


def _direct_path() -> bool:
    return (
        triton.__version__.startswith(DIRECT_TRITON)
        and not knobs.runtime.interpret
        and not _hooked(knobs.runtime.launch_enter_hook)
        and not _hooked(knobs.runtime.launch_exit_hook)
    )


def _hooked(hook) -> bool:
    """Whether a launch hook would run: set, and not an empty chain (the release's default)."""
    return hook is not None and getattr(hook, "calls", True) != []


class DirectLaunch:
    """``DirectLaunch(kernel)(grid, *args, **kwargs)`` launches ``kernel`` like ``kernel[grid](*args, **kwargs)``:
    ``args`` its runtime parameters in order, ``kwargs`` its constexprs by name and launch options (num_warps…).
    The kernel's runtime parameters must all come before its constexprs."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        fn = getattr(kernel, "fn", None)  # the JIT's and the interpreter's kernels; None for a test's stand-in
        params = list(inspect.signature(fn).parameters.values()) if fn is not None else []
        is_constexpr = ["constexpr" in str(param.annotation) for param in params]
        first_constexpr = is_constexpr.index(True) if True in is_constexpr else len(params)
        if not all(is_constexpr[first_constexpr:]):
            raise ValueError(f"{kernel}: runtime parameters after a constexpr; DirectLaunch takes them in order")
        self.checked = fn is not None
        self.runtime_params = first_constexpr
        self.constexpr_names = tuple(param.name for param in params[first_constexpr:])
        self.compiled: dict = {}

    def __call__(self, grid: tuple, *args, **kwargs) -> None:
        if self.checked:  # on every path, so the interpreter's tests check each call site
            self._check_call(args, kwargs)
        if not self.checked or self.kernel.pre_run_hooks or not _direct_path():
            self.kernel[grid](*args, **kwargs)
            return
        device = driver.active.get_current_device()
        arguments, values = [], []
        try:
            for arg in args:
                if type(arg) is int:  # its own key
                    arguments.append(arg)
                    values.append(arg)
                elif type(arg) is torch.Tensor and arg.is_cuda:
                    address = arg.data_ptr()
                    arguments.append((arg.dtype, address % 16 == 0))
                    values.append(address)  # the launcher takes an address as given, without asking the driver
                else:
                    arguments.append(_argument_key(arg))
                    values.append(arg)
        except TypeError:  # a kind Triton may specialise otherwise: its own path
            self.kernel[grid](*args, **kwargs)
            return
        # the constexprs and options in the call's order: a call site naming them in another order keys a second entry
        key = (
            tuple(arguments),
            tuple(kwargs.items()),
            device,
            knobs.runtime.debug,
            knobs.compilation.instrumentation_mode,
        )
        compiled = self.compiled.get(key)
        if compiled is None:  # Triton binds, specialises, compiles or finds, and launches
            self.compiled[key] = self.kernel[grid](*args, **kwargs)
            return
        stream = driver.active.get_current_stream(device)
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        compiled.run(
            grid[0], grid_y, grid_z, stream, compiled.function, compiled.packed_metadata, None, None, None,
            *values, *[kwargs[name] for name in self.constexpr_names],
        )  # fmt: skip

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        missing = [name for name in self.constexpr_names if name not in kwargs]
        if len(args) != self.runtime_params or missing:
            raise TypeError(
                f"{self.kernel}: {len(args)} positional arguments for its {self.runtime_params} runtime parameters, "
                f"constexprs missing from the keywords: {missing}; pass the runtime ones in order, the constexprs "
                f"by name"
            )


@functools.cache
def direct(kernel) -> DirectLaunch:
    """The one :class:`DirectLaunch` of ``kernel``: ``direct(kernel)(grid, *args, **kwargs)``."""
    return DirectLaunch(kernel)

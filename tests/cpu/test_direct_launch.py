"""DirectLaunch: its cache key separates every argument Triton's JIT specialises differently, a repeat call with
the same key launches the cached kernel with the runtime arguments then the constexprs in the kernel's order, and
off its release, under the interpreter or with hooks every call goes through the JIT. The launches themselves
run on a GPU (tests/gpu/test_triton_gpu.py goes through them on Triton 3.6)."""

import itertools
from types import SimpleNamespace

import pytest
import torch
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.tools.tensor_descriptor import TensorDescriptor

from mtraining_kernels import direct_launch
from mtraining_kernels.direct_launch import DirectLaunch


def _specialisation(arg):
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def _arguments():
    rows = torch.zeros(8, 64)
    half = torch.zeros(8, 64, dtype=torch.bfloat16)
    return [
        *(0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 1, 2**31, 2**40),
        True,
        False,
        0.5,
        1.0,
        None,
        rows,
        rows[1:],  # 256 bytes in: aligned
        rows[:, 1:],  # 4 bytes in
        half,
        half[:, 3:],  # 6 bytes in
        TensorDescriptor.from_tensor(half, [4, 32]),
        TensorDescriptor.from_tensor(half, [8, 32]),
        TensorDescriptor.from_tensor(rows, [4, 32]),
    ]


def test_keys_differ_wherever_triton_specialises_differently():
    arguments = _arguments()
    for a, b in itertools.combinations(arguments, 2):
        if _specialisation(a) != _specialisation(b):
            assert direct_launch._argument_key(a) != direct_launch._argument_key(b), (a, b)
    assert len({direct_launch._argument_key(a) for a in arguments}) > 1  # hashable, and not all one key


def test_an_argument_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="got <class 'str'>"):
        direct_launch._argument_key("x")


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, launches):
        self.launches = launches

    def run(self, *args):
        self.launches.append(("direct", args))


def _signature(x, n, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pass


class _Kernel:
    """Stands for a JIT kernel of runtime parameters (x, n) and constexprs (BLOCK, FLAG)."""

    def __init__(self, fn=None):
        self.fn = fn or _signature
        self.launches = []
        self.pre_run_hooks = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(("jit", grid, args, kwargs))
            return _Compiled(self.launches)

        return launch


class _Driver:
    @staticmethod
    def get_current_device():
        return 0

    @staticmethod
    def get_current_stream(device):
        return 7


@pytest.fixture
def direct_path(monkeypatch):
    monkeypatch.setattr(direct_launch, "_direct_path", lambda: True)
    monkeypatch.setattr(direct_launch, "driver", SimpleNamespace(active=_Driver()))


def test_a_repeat_call_launches_the_cached_kernel(direct_path):
    kernel = _Kernel()
    launch = DirectLaunch(kernel)
    x = torch.zeros(64)
    launch((3, 2), x, 32, BLOCK=64, FLAG=True, num_warps=4)
    assert kernel.launches == [("jit", (3, 2), (x, 32), dict(BLOCK=64, FLAG=True, num_warps=4))]
    launch((5,), x, 32, BLOCK=64, FLAG=True, num_warps=4)
    assert kernel.launches[1] == ("direct", (5, 1, 1, 7, "function", "metadata", None, None, None, x, 32, 64, True))


@pytest.mark.parametrize(
    "change",
    [
        dict(x=torch.zeros(64)[1:]),  # 4 bytes in: no longer 16-byte aligned
        dict(x=torch.zeros(64, dtype=torch.float16)),
        dict(n=33),
        dict(n=1),
        dict(BLOCK=128),
        dict(num_warps=8),
    ],
    ids=["alignment", "dtype", "int", "one", "constexpr", "option"],
)
def test_a_call_with_another_key_goes_through_the_jit(direct_path, change):
    kernel = _Kernel()
    launch = DirectLaunch(kernel)
    first = dict(x=torch.zeros(64), n=32, BLOCK=64, FLAG=True, num_warps=4)
    second = {**first, **change}
    for arguments in (first, second):
        launch((1,), arguments.pop("x"), arguments.pop("n"), **arguments)
    assert [entry[0] for entry in kernel.launches] == ["jit", "jit"]


def test_an_argument_it_does_not_key_goes_through_the_jit(direct_path):
    kernel = _Kernel()
    launch = DirectLaunch(kernel)
    for _ in range(2):
        launch((1,), torch.zeros(64), "32", BLOCK=64, FLAG=True)
    assert [entry[0] for entry in kernel.launches] == ["jit", "jit"]


def test_off_the_direct_path_every_call_goes_through_the_jit(monkeypatch):
    monkeypatch.setattr(direct_launch.triton, "__version__", "3.8.0")
    kernel = _Kernel()
    launch = DirectLaunch(kernel)
    for _ in range(2):
        launch((1,), torch.zeros(64), 32, BLOCK=64, FLAG=True)
    assert [entry[0] for entry in kernel.launches] == ["jit", "jit"]


@pytest.mark.parametrize("setting", ["interpreter", "launch_hook"])
def test_the_interpreter_or_a_launch_hook_takes_the_jit(monkeypatch, setting):
    monkeypatch.setattr(direct_launch.triton, "__version__", direct_launch.DIRECT_TRITON + "0")
    if setting == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.setattr(direct_launch.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    assert not direct_launch._direct_path()


def test_a_runtime_parameter_after_a_constexpr_is_refused():
    def signature(x, BLOCK: tl.constexpr, n):
        pass

    with pytest.raises(ValueError, match="runtime parameters after a constexpr"):
        DirectLaunch(_Kernel(signature))


@pytest.mark.parametrize("call", ["constexpr_by_position", "constexpr_missing"])
def test_a_call_that_does_not_name_its_constexprs_is_refused_on_every_path(call):
    launch = DirectLaunch(_Kernel())
    with pytest.raises(TypeError, match="pass the runtime ones in order, the constexprs by name"):
        if call == "constexpr_by_position":
            launch((1,), torch.zeros(64), 32, 64, FLAG=True)
        else:
            launch((1,), torch.zeros(64), 32, FLAG=True)

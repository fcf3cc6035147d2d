"""Benchmark-only: emulate slower links between "nodes" of one host (DESIGN.md §2.5).

On one host every GPU pair shares NVLink, so a hierarchical ring's outer transfers are as fast as its
inner ones and the hierarchy has nothing to hide. To measure what it hides, a benchmark groups the CP
ranks into emulated nodes of ``node_size`` consecutive ranks and makes every transfer that crosses a
node boundary ``slowdown`` times slower: its data is usable no sooner than

    delay = (slowdown − 1) · bytes / inner_bytes_per_s

after it was posted, on top of the real transfer (``inner_bytes_per_s`` is the measured intra-node
bandwidth). Compute runs during the delay exactly as it runs during a real transfer: on a GPU the
delay is a sleep kernel on a side stream that the compute stream waits for only when the ring waits
for the data; on the CPU the waiting rank sleeps only for what is left of the delay.

Use :class:`SlowLinkRingGroups` in place of :class:`~megatron_mtraining.ring.groups.RingGroups`; never in
training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_mtraining.ring.comm import RingExchange
from megatron_mtraining.ring.groups import RingGroups


@dataclass(frozen=True)
class SlowLink:
    """Nodes of ``node_size`` consecutive CP ranks; links between nodes ``slowdown`` × slower than
    ``inner_bytes_per_s``."""

    node_size: int
    slowdown: float
    inner_bytes_per_s: float

    def __post_init__(self):
        if self.node_size < 1:
            raise ValueError(f"node_size={self.node_size} must be >= 1")
        if not self.slowdown >= 1.0:
            raise ValueError(f"slowdown={self.slowdown} must be >= 1 (1 = no emulated delay)")
        if not self.inner_bytes_per_s > 0:
            raise ValueError(f"inner_bytes_per_s={self.inner_bytes_per_s} must be > 0; measure it first")

    def crosses(self, src_cp_rank: int, dst_cp_rank: int) -> bool:
        return src_cp_rank // self.node_size != dst_cp_rank // self.node_size

    def delay_s(self, nbytes: int) -> float:
        return (self.slowdown - 1.0) * nbytes / self.inner_bytes_per_s


class _HostDelay:
    """CPU: the data is usable ``delay`` seconds after the post; the wait sleeps for what is left."""

    def __init__(self, delay_s: float):
        self.ready_at = time.perf_counter() + delay_s

    def finish(self) -> None:
        time.sleep(max(0.0, self.ready_at - time.perf_counter()))


class _DeviceDelay:
    """CUDA: a sleep kernel on a side stream, started when the post is reached on the current stream;
    :meth:`finish` makes the current stream wait for it."""

    _cycles_per_s: dict[int, float] = {}
    _side_streams: dict[int, torch.cuda.Stream] = {}

    def __init__(self, delay_s: float):
        device = torch.cuda.current_device()
        current = torch.cuda.current_stream()
        side = self._side_streams.setdefault(device, torch.cuda.Stream())
        side.wait_stream(current)
        with torch.cuda.stream(side):
            torch.cuda._sleep(max(1, int(delay_s * self._clock(device))))
        self.done = torch.cuda.Event()
        self.done.record(side)

    @classmethod
    def _clock(cls, device: int) -> float:
        """Sleep-kernel cycles per second on ``device``, measured once."""
        if device not in cls._cycles_per_s:
            cycles = 20_000_000
            torch.cuda._sleep(cycles)  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            cls._cycles_per_s[device] = cycles / (start.elapsed_time(end) / 1e3)
        return cls._cycles_per_s[device]

    def finish(self) -> None:
        torch.cuda.current_stream().wait_event(self.done)


class SlowLinkExchange(RingExchange):
    """A :class:`RingExchange` whose incoming transfer is delayed when it crosses an emulated node boundary."""

    def __init__(self, group: dist.ProcessGroup, cp_members: list[int], link: SlowLink, tag: int = 0):
        super().__init__(group, tag)
        me = cp_members.index(dist.get_rank())
        self.link = link
        self.slow = self.size > 1 and link.crosses(cp_members.index(self.prev_peer), me)
        self._delay: _HostDelay | _DeviceDelay | None = None

    def post(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        received = super().post(tensor, out)
        if self.slow:
            delay_s = self.link.delay_s(tensor.numel() * tensor.element_size())
            self._delay = _DeviceDelay(delay_s) if tensor.is_cuda else _HostDelay(delay_s)
        return received

    def wait(self) -> None:
        super().wait()
        if self._delay is not None:
            self._delay.finish()
            self._delay = None


@dataclass(frozen=True)
class SlowLinkRingGroups(RingGroups):
    """Ring groups whose exchanges emulate :class:`SlowLink` between nodes (benchmarks only)."""

    link: SlowLink | None = None

    @classmethod
    def wrap(cls, groups: RingGroups, link: SlowLink) -> "SlowLinkRingGroups":
        if groups.outer is not None and link.node_size != groups.inner_size:
            raise ValueError(
                f"a hierarchical ring's nodes are its inner rings: node_size={link.node_size} must be "
                f"the inner size {groups.inner_size}"
            )
        if groups.world_size % link.node_size:
            raise ValueError(f"node_size={link.node_size} does not divide the CP size {groups.world_size}")
        return cls(cp=groups.cp, inner=groups.inner, outer=groups.outer, link=link)

    def exchange(self, group: dist.ProcessGroup, tag: int = 0) -> RingExchange:
        return SlowLinkExchange(group, dist.get_process_group_ranks(self.cp), self.link, tag)

"""The GPU's clocks, power and temperature while a timed block runs, sampled by ``nvidia-smi`` in the background.

Two timings of the same code can differ by a few percent when the GPU lowers its clocks (power limit, heat):
a benchmark row that records what the clocks were can tell that apart from a change in the code.
"""

from __future__ import annotations

import statistics
import subprocess
import threading

import torch

QUERY = "clocks.sm,power.draw,temperature.gpu"


def nvidia_smi_id(device: int) -> str:
    """The PCI address of CUDA device ``device`` as ``nvidia-smi -i`` takes it (CUDA and NVML number GPUs
    differently)."""
    props = torch.cuda.get_device_properties(device)
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


def summarize(lines: list[str]) -> dict[str, float]:
    """``sm_clock_mhz`` (median), ``sm_clock_min_mhz``, ``power_max_w``, ``temperature_max_c`` of ``nvidia-smi``
    CSV lines "clock, power, temperature" (no header, no units); lines that do not parse (e.g. "[N/A]") are
    skipped; no parsed line: an empty dict."""
    samples = []
    for line in lines:
        try:
            samples.append([float(field) for field in line.split(",")])
        except ValueError:
            continue
    samples = [sample for sample in samples if len(sample) == 3]
    if not samples:
        return {}
    clocks, power, temperature = zip(*samples)
    return {
        "sm_clock_mhz": statistics.median(clocks),
        "sm_clock_min_mhz": min(clocks),
        "power_max_w": max(power),
        "temperature_max_c": max(temperature),
    }


class Telemetry:
    """``with Telemetry(device) as telemetry: ...`` queries ``nvidia-smi`` every ``period_s`` from a background
    thread while the block runs, the first time ``period_s`` after it starts (one complete query each time: a
    looping ``nvidia-smi`` writing into a pipe may hold its samples in a buffer until it exits); then
    ``telemetry.summary`` is :func:`summarize`'s dict, empty where ``nvidia-smi`` is missing or printed nothing
    usable (``telemetry.note`` says why), and empty with no note for a block shorter than ``period_s``. A sample
    taken as the block starts would report the GPU as the previous work left it (docs/benchmarks.md, session 38,
    item 5), so a short block gets no clocks rather than those."""

    def __init__(self, device: int = 0, period_s: float = 0.25):
        self.summary: dict[str, float] = {}
        self.note = ""
        self.command = None
        try:
            gpu = nvidia_smi_id(device)
        except (AssertionError, AttributeError, RuntimeError) as error:  # no CUDA, or a torch without PCI ids
            self.note = f"no telemetry: no PCI address of CUDA device {device} ({error})"
        else:
            self.command = ["nvidia-smi", f"--id={gpu}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
        self.period_s = period_s
        self._lines: list[str] = []
        self._queries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while self.command and not self._stop.wait(self.period_s):
            self._queries += 1
            try:
                result = subprocess.run(self.command, capture_output=True, text=True, timeout=10)
            except (OSError, subprocess.TimeoutExpired) as error:
                self.note = f"no telemetry: {error}"
                return
            self._lines += result.stdout.splitlines()

    def __enter__(self) -> Telemetry:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.summary = summarize(self._lines)
        if not self.summary and not self.note and self._queries:
            self.note = f"no telemetry: {' '.join(self.command)} printed no samples"

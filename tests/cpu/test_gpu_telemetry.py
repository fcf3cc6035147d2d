"""tools/gpu_telemetry.py's summary of nvidia-smi's samples, and its answer where nvidia-smi is missing."""

import sys
import time

import pytest
from tool_modules import load_tool

gpu_telemetry = load_tool("gpu_telemetry")


def test_summary_of_the_samples_skips_what_does_not_parse():
    lines = ["1980, 650.5, 61", "1755, 699.9, 66", "[N/A], [N/A], [N/A]", "1830, 690.0, 64", ""]
    assert gpu_telemetry.summarize(lines) == {
        "sm_clock_mhz": 1830.0,
        "sm_clock_min_mhz": 1755.0,
        "power_max_w": 699.9,
        "temperature_max_c": 66.0,
    }
    assert gpu_telemetry.summarize(["[N/A], [N/A], [N/A]"]) == {}


def test_without_nvidia_smi_the_block_runs_and_the_summary_is_empty(monkeypatch):
    monkeypatch.setattr(gpu_telemetry, "nvidia_smi_id", lambda device: "00000000:18:00.0")
    telemetry = gpu_telemetry.Telemetry(period_s=0.01)
    telemetry.command[0] = "/nonexistent/nvidia-smi"
    ran = False
    with telemetry:
        time.sleep(0.1)
        ran = True
    assert ran and telemetry.summary == {} and "no telemetry" in telemetry.note


def test_a_block_shorter_than_the_period_gets_no_samples_and_no_note(monkeypatch):
    """The first sample waits a period: a short block would otherwise get the GPU's state from before it."""
    monkeypatch.setattr(gpu_telemetry, "nvidia_smi_id", lambda device: "00000000:18:00.0")
    telemetry = gpu_telemetry.Telemetry(period_s=30.0)
    telemetry.command = [sys.executable, "-c", "print('1980, 120.0, 40')"]
    with telemetry:
        pass
    assert telemetry.summary == {} and telemetry.note == ""


@pytest.mark.parametrize("text", ["1980, 650", "x, y, z"])
def test_malformed_lines_give_no_summary(text):
    assert gpu_telemetry.summarize([text]) == {}


def test_samples_are_taken_while_the_block_runs(monkeypatch):
    """A stand-in for nvidia-smi printing one sample per call; the block lasts several periods."""
    monkeypatch.setattr(gpu_telemetry, "nvidia_smi_id", lambda device: "00000000:18:00.0")
    telemetry = gpu_telemetry.Telemetry(period_s=0.01)
    telemetry.command = [sys.executable, "-c", "print('1410, 500.0, 55')"]
    with telemetry:
        time.sleep(0.2)
    assert telemetry.summary == {
        "sm_clock_mhz": 1410.0,
        "sm_clock_min_mhz": 1410.0,
        "power_max_w": 500.0,
        "temperature_max_c": 55.0,
    }
    assert telemetry.note == ""


def test_without_a_pci_address_there_is_no_telemetry_and_no_error(monkeypatch):
    def no_device(device):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(gpu_telemetry, "nvidia_smi_id", no_device)
    with gpu_telemetry.Telemetry() as telemetry:
        pass
    assert telemetry.summary == {} and "no PCI address" in telemetry.note

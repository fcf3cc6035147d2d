"""MTraining's per-step metrics in a Megatron run, and the step end that checks and logs them.

:func:`gather_step_metrics` reduces every rank's attention statistics (density, ring imbalance, index
time) into one :class:`StepMetrics`; :func:`log_step_metrics` prints it on the last rank and writes it
to Megatron's TensorBoard and W&B writers; :class:`MTrainingStepEnd` is the model config's
``finalize_model_grads_func`` that also asserts the index caches are empty at the end of every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.training import get_args, get_tensorboard_writer, get_wandb_writer, print_rank_last

from .attention_stats import collect_stats
from .index_cache import assert_index_caches_empty
from .ring.consensus import collective_device


@dataclass(frozen=True)
class StepMetrics:
    """MTraining metrics of one training step (its last micro-batch), reduced over all ranks.

    ``density`` maps 1-based layer numbers to |M| / causal area averaged over samples, heads and
    ranks (1.0 for dense layers; packed documents: the listed work over that of every document dense).
    Imbalances are the worst layer's, from the layer's index (``balance_report``: max/mean of ring work
    over ranks, and over each ring step). ``index_seconds`` sums, over layers, the slowest rank's index
    estimation time. Packed documents: ``documents_per_sequence`` (mean over ranks and layers) and
    ``clamped_documents`` (documents whose static budget was clamped to their length, summed over layers,
    the largest count of any rank); both None without packed documents.
    """

    density: dict[int, float]
    worker_imbalance: float
    step_imbalance: float
    index_seconds: float
    documents_per_sequence: float | None = None
    clamped_documents: int | None = None

    @property
    def mean_density(self) -> float:
        return sum(self.density.values()) / len(self.density)


def gather_step_metrics(model_chunks, num_layers: int, group: dist.ProcessGroup | None = None) -> StepMetrics | None:
    """Collective over ``group`` (default: all ranks): the :class:`StepMetrics` of the latest training forward.

    Every rank of ``group`` must call it; returns None when no rank has MTraining attention stats.
    """
    device = collective_device(group)
    # per layer: density sum, reports, documents-per-sequence sum, packed reports
    sums = torch.zeros(4, num_layers, dtype=torch.float64, device=device)
    # per layer: worker, step imbalance, seconds, clamped documents
    maxima = torch.zeros(4, num_layers, dtype=torch.float64, device=device)
    for stats in collect_stats(model_chunks):
        layer = stats.layer_number - 1
        balance = stats.balance()
        documents = stats.documents_per_sequence
        packed = [documents, 1.0] if documents is not None else [0.0, 0.0]
        sums[:, layer] += torch.tensor([stats.density, 1.0, *packed], dtype=torch.float64, device=device)
        maxima[:, layer] = torch.maximum(
            maxima[:, layer],
            torch.tensor(
                [balance.worker_imbalance, balance.step_imbalance, stats.estimation_seconds, stats.clamped_documents],
                dtype=torch.float64,
                device=device,
            ),
        )
    dist.all_reduce(sums, group=group)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    sums, maxima = sums.cpu(), maxima.cpu()
    reported = sums[1] > 0
    if not reported.any():
        return None
    density = {layer + 1: float(sums[0, layer] / sums[1, layer]) for layer in reported.nonzero().flatten().tolist()}
    packed_reports = float(sums[3].sum())
    documents_per_sequence = float(sums[2].sum()) / packed_reports if packed_reports else None
    clamped = int(maxima[3].sum()) if packed_reports else None
    return StepMetrics(
        density, float(maxima[0].max()), float(maxima[1].max()), float(maxima[2].sum()), documents_per_sequence, clamped
    )


def log_step_metrics(metrics: StepMetrics, iteration: int) -> None:
    """One line on the last rank, and scalars to Megatron's TensorBoard and W&B writers (where configured)."""
    packed = ""
    if metrics.documents_per_sequence is not None:
        packed = (
            f" | documents/sequence {metrics.documents_per_sequence:.1f} | clamped budgets {metrics.clamped_documents}"
        )
    print_rank_last(
        f" mtraining | iteration {iteration:8d} | density {metrics.mean_density:.4f} | worker imbalance "
        f"{metrics.worker_imbalance:.3f} | step imbalance {metrics.step_imbalance:.3f} | index time "
        f"{metrics.index_seconds * 1e3:.1f} ms{packed}"
    )
    scalars = {
        "mtraining/density": metrics.mean_density,
        "mtraining/worker-imbalance": metrics.worker_imbalance,
        "mtraining/step-imbalance": metrics.step_imbalance,
        "mtraining/index-time-ms": metrics.index_seconds * 1e3,
    }
    if metrics.documents_per_sequence is not None:
        scalars["mtraining/documents-per-sequence"] = metrics.documents_per_sequence
        scalars["mtraining/clamped-budgets"] = metrics.clamped_documents
    scalars.update({f"mtraining/density-layer-{layer:03d}": value for layer, value in metrics.density.items()})
    writer, wandb_writer = get_tensorboard_writer(), get_wandb_writer()
    if writer is not None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, iteration)
    if wandb_writer is not None:
        wandb_writer.log(scalars, iteration)


class MTrainingStepEnd:
    """The model config's ``finalize_model_grads_func``: Megatron's ``finalize_model_grads``, then MTraining's step end.

    Megatron calls it on every rank once per training step, after the last backward: the index
    caches must be empty by then (every checkpointed forward was replayed), and every
    ``stats_interval`` iterations the metrics are gathered and logged.
    """

    def __init__(self, num_layers: int, stats_interval: int):
        self.num_layers = num_layers
        self.stats_interval = stats_interval

    def __call__(self, model_chunks, num_tokens=None, pg_collection=None, force_all_reduce=False):
        finalize_model_grads(model_chunks, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        assert_index_caches_empty(model_chunks)
        iteration = get_args().curr_iteration + 1
        if self.stats_interval and iteration % self.stats_interval == 0:
            metrics = gather_step_metrics(model_chunks, self.num_layers)
            if metrics is not None:
                log_step_metrics(metrics, iteration)

"""Packed documents through a tiny Megatron GPTModel with MTraining's spec on gloo CPU ranks (DESIGN.md §2.7).

The documents reach the attention as ``PackedDocuments`` in ``packed_seq_params`` and RoPE takes per-document
position ids (``LayoutRotaryEmbedding(per_token_positions=True)``), on the ``torch`` backend:

* CP = 2 (striped, zigzag, contiguous) gives the loss and every parameter gradient of CP = 1, with the full
  pattern (every document dense) and with per-document sparse indices;
* at CP = 1 the torch backend equals the reference oracle on the packed mask;
* one document per sample is bitwise the unpacked path, at CP = 1 and CP = 2;
* full recomputation replays the cached per-document index;
* the document mask changes the result, and per-token RoPE is the table at the documents' positions;
* packed layers keep their statistics (density, documents per sequence, balance), which reach the step metrics;
* the SDPA dense impls, THD ``PackedSeqParams`` and documents of another batch are refused.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
from megatron_cpu import megatron_on_cpu
from test_megatron_model import _init_parallel, _transformer_config

from mtraining_kernels.layout import Layout

SEQ_LEN = 512
BATCH = 2
VOCAB = 128
EOD = 0
DOCUMENT_LENGTHS = ([300, 1, 60, 151], [129, 383])  # straddle blocks and ranks; 1 and 60 stay dense
MIN_SPARSE_LENGTH = 128
SPARSE_SETTINGS = dict(budget="static", vertical_size=12, slash_size=2, sink_tokens=4, local_window=1, last_q=64)
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5
LAYOUTS = ("striped", "skewed", "zigzag", "contiguous")
# the micro-batch's own skewed turns, carried by PackedDocuments as get_batch plans them (--mtraining-plan-turns):
# at CP = 2 and 512 tokens, round 0 turned by 1 and round 1 by 0 is neither striped's (0, 0) nor skewed's (0, 1)
BATCH_TURNS = (1, 0)
# the statistics' batch: its 412-token document spans all four 128-token blocks (distances 0..3); its one free slash
# (local_window=1 takes offset 0) switches on at most two of the distances 1..3, and 12 bars cost less than a block,
# so its listed work is below dense for any data (three-block documents can be fully listed, density 1.0)
STATISTICS_LENGTHS = ([300, 1, 60, 151], [100, 412])


def _mtraining(kind: str, layout: str = "striped", backend: str = "torch", **extra):
    from megatron_mtraining.config import MTrainingConfig

    base = dict(backend=backend, layout=layout, min_sparse_length=MIN_SPARSE_LENGTH, **extra)
    if kind == "full":
        return MTrainingConfig(dense=True, **base)
    return MTrainingConfig(**base, **SPARSE_SETTINGS)


def _build_model(mtraining, cp: int, state_dict=None, **extra):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_mtraining.layout import install_layout_rope
    from megatron_mtraining.spec import get_gpt_layer_mtraining_spec

    config = _transformer_config(cp=cp, **extra)
    torch.manual_seed(0)
    model = GPTModel(
        config,
        get_gpt_layer_mtraining_spec(config, mtraining=mtraining),
        vocab_size=VOCAB,
        max_sequence_length=SEQ_LEN,
        position_embedding_type="rope",
        rotary_base=1_000_000,
        share_embeddings_and_output_weights=True,
    )
    if state_dict is not None:
        model.load_state_dict(state_dict)
    install_layout_rope(
        model, mtraining.layout_for(cp), parallel_state.get_context_parallel_group(), per_token_positions=True
    )
    return model


def _packed_batch(seed: int, lengths=DOCUMENT_LENGTHS) -> dict:
    """Tokens without EOD except at the end of every document; positions and documents as Megatron draws them
    with ``--reset-position-ids --reset-attention-mask``."""
    from mtraining_kernels.documents import Documents

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (BATCH, SEQ_LEN), generator=gen)
    for sample, sample_lengths in enumerate(lengths):
        ends = torch.tensor(sample_lengths).cumsum(0) - 1
        tokens[sample, ends] = EOD
    documents = Documents.from_eod(tokens, EOD)
    return {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, dims=1),
        "loss_mask": (torch.rand(BATCH, SEQ_LEN, generator=gen) < 0.8).float(),
        "position_ids": documents.position_ids,
        "documents": documents,
    }


def _train_step(model, batch, layout, packed: bool = True):
    """Forward + backward on this rank's positions: (loss summed over CP, gradients summed over CP)."""
    from megatron.core import parallel_state

    from megatron_mtraining.attention import PackedDocuments
    from megatron_mtraining.layout import select_layout_positions

    cp_group = parallel_state.get_context_parallel_group()
    tensors = {key: batch[key] for key in ("tokens", "labels", "loss_mask", "position_ids")}
    local = select_layout_positions(tensors, layout, dist.get_rank(cp_group))
    per_token = model(
        local["tokens"],
        local["position_ids"],
        None,
        labels=local["labels"],
        packed_seq_params=PackedDocuments(batch["documents"], layout if layout.turns else None) if packed else None,
    )
    loss = (per_token * local["loss_mask"]).sum()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=cp_group)
        grads[name] = grad
    return total, grads


def _differences(reference, result) -> dict[str, float]:
    (ref_loss, ref_grads), (loss, grads) = reference, result
    diffs = {"loss": abs(float(loss - ref_loss)) / abs(float(ref_loss))}
    for name, ref in ref_grads.items():
        diffs[f"grad {name}"] = float((grads[name] - ref).abs().max() / ref.abs().max())
    return diffs


def _bitwise(first, second) -> bool:
    return bool(torch.equal(first[0], second[0])) and all(torch.equal(first[1][n], second[1][n]) for n in first[1])


def _equivalence(kind: str, seed: int) -> dict:
    """CP = 1 (torch and reference backends), then CP = 2 in every layout, on one packed batch."""
    batch = _packed_batch(seed)
    _init_parallel(1, 1)
    reference_model = _build_model(_mtraining(kind), 1)
    weights = {
        key: value.clone() if torch.is_tensor(value) else value for key, value in reference_model.state_dict().items()
    }
    reference = _train_step(reference_model, batch, _mtraining(kind).layout_for(1))
    oracle = _train_step(
        _build_model(_mtraining(kind, backend="reference"), 1, weights), batch, _mtraining(kind).layout_for(1)
    )
    report = {"reference backend": _differences(reference, oracle), "layouts": {}}
    unmasked = _train_step(_build_model(_mtraining(kind), 1, weights), batch, _mtraining(kind).layout_for(1), False)
    report["unmasked"] = _differences(reference, unmasked)
    for layout in LAYOUTS:
        _init_parallel(1, 2)
        mt = _mtraining(kind, layout)
        report["layouts"][layout] = _differences(
            reference, _train_step(_build_model(mt, 2, weights), batch, mt.layout_for(2))
        )
    _init_parallel(1, 2)
    model = _build_model(_mtraining(kind, "skewed"), 2, weights)
    turned = _train_step(model, batch, Layout("skewed", 2, turns=BATCH_TURNS))
    report["layouts"][f"skewed turns {BATCH_TURNS}"] = _differences(reference, turned)
    return report


def _one_document(seed: int) -> dict[str, bool]:
    """One document per sample: the packed path equals the unpacked one bitwise (sparse, CP = 1 and 2)."""
    from mtraining_kernels.documents import Documents

    batch = _packed_batch(seed, lengths=([SEQ_LEN], [SEQ_LEN]))
    batch["tokens"][:, -1] = EOD  # an EOD in the last position starts nothing
    batch["documents"] = Documents.from_eod(batch["tokens"], EOD)
    assert bool((batch["documents"].num_documents == 1).all())
    equal = {}
    for cp in (1, 2):
        _init_parallel(1, cp)
        mt = _mtraining("sparse")
        runs = [_train_step(_build_model(mt, cp), batch, mt.layout_for(cp), packed) for packed in (True, False)]
        equal[f"cp{cp}"] = _bitwise(*runs)
    return equal


def _recompute(seed: int) -> dict:
    """CP = 2, sparse: full recomputation replays the cached per-document index (one estimation per layer, the
    caches end empty) and gives the gradients of the run without recomputation."""
    from megatron_mtraining.attention import MTrainingAttention
    from megatron_mtraining.index_cache import assert_index_caches_empty

    batch = _packed_batch(seed)
    _init_parallel(1, 2)
    mt = _mtraining("sparse")
    plain = _train_step(_build_model(mt, 2), batch, mt.layout_for(2))
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    model = _build_model(mt, 2, **full)
    recomputed = _train_step(model, batch, mt.layout_for(2))
    assert_index_caches_empty([model])
    estimations = [m.estimations for m in model.modules() if isinstance(m, MTrainingAttention)]
    return {"diffs": _differences(plain, recomputed), "estimations": estimations}


def _statistics(seed: int) -> dict:
    """CP = 2, striped: every layer's ``last_stats`` of a packed training step, and the step metrics over the group."""
    from megatron.core import parallel_state

    from megatron_mtraining.attention_stats import collect_stats
    from megatron_mtraining.step_metrics import gather_step_metrics

    batch = _packed_batch(seed, lengths=STATISTICS_LENGTHS)
    report = {"expected documents per sequence": float(batch["documents"].num_documents.double().mean())}
    for kind in ("full", "sparse"):
        _init_parallel(1, 2)
        mt = _mtraining(kind)
        model = _build_model(mt, 2)
        _train_step(model, batch, mt.layout_for(2))
        stats = collect_stats([model])
        metrics = gather_step_metrics([model], len(stats), parallel_state.get_context_parallel_group())
        report[kind] = {
            "layers": len(stats),
            "density": [s.density for s in stats],
            "documents per sequence": [s.documents_per_sequence for s in stats],
            "worker imbalance": [s.balance().worker_imbalance for s in stats],
            "metrics": (metrics.documents_per_sequence, metrics.clamped_documents, metrics.mean_density),
        }
    return report


def _rope_positions(seed: int) -> float:
    """Per-token RoPE vs the full table gathered at the documents' positions in layout order (CP = 2, striped)."""
    from megatron.core import parallel_state

    from megatron_mtraining.layout import LayoutRotaryEmbedding, select_layout_positions

    batch = _packed_batch(seed)
    _init_parallel(1, 2)
    layout = _mtraining("full").layout_for(2)
    model = _build_model(_mtraining("full"), 2)
    rope = model.rotary_pos_emb
    assert isinstance(rope, LayoutRotaryEmbedding) and rope.per_token_positions
    rank = dist.get_rank(parallel_state.get_context_parallel_group())
    local = select_layout_positions({"position_ids": batch["position_ids"]}, layout, rank)["position_ids"]
    rope.position_ids = local
    table = rope.rotary.get_emb(SEQ_LEN)
    expected = table[local.T, 0]  # [N/W, b, 1, dim]
    return float((rope(SEQ_LEN) - expected).abs().max())


def _refusals(seed: int) -> dict[str, str]:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mtraining.attention import MTrainingAttention, PackedDocuments
    from mtraining_kernels.documents import Documents

    _init_parallel(1, 1)
    documents = _packed_batch(seed)["documents"]
    q, kv = torch.zeros(SEQ_LEN, BATCH, 4, 16), torch.zeros(SEQ_LEN, BATCH, 2, 16)

    def message(packed_seq_params, kind: str = "sparse", **settings) -> str:
        attention = MTrainingAttention(
            config=_transformer_config(),
            layer_number=1,
            attn_mask_type=AttnMaskType.causal,
            mtraining=_mtraining(kind, **settings),
        )
        try:
            attention(q, kv, kv, None, packed_seq_params=packed_seq_params)
        except ValueError as error:
            return str(error)
        return "accepted"

    return {
        "sdpa": message(PackedDocuments(documents), "full", dense_impl="sdpa_cudnn"),
        "thd": message(PackedSeqParams(qkv_format="thd")),
        "other batch": message(PackedDocuments(Documents.single(1, SEQ_LEN))),
    }


def _report(rank, world_size, seed):
    report = {}
    with megatron_on_cpu():
        for kind in ("full", "sparse"):
            try:
                report[kind] = _equivalence(kind, seed)
            except Exception:  # noqa: BLE001 - one kind's failure must not hide the other's result
                report[kind] = traceback.format_exc()
        report["one document"] = _one_document(seed)
        report["recompute"] = _recompute(seed)
        report["rope"] = _rope_positions(seed)
        report["statistics"] = _statistics(seed)
        report["refusals"] = _refusals(seed)
    return report if rank == 0 else None


@pytest.fixture(scope="module")
def packed_report():
    from harness import run_on_ranks

    seed = int.from_bytes(os.urandom(4), "little")
    return seed, run_on_ranks(_report, 2, seed)[0]


@pytest.mark.parametrize("kind", ["full", "sparse"])
def test_packed_model_cp2_matches_cp1(packed_report, kind):
    seed, report = packed_report
    result = report[kind]
    assert isinstance(result, dict), f"the run failed (seed={seed}):\n{result}"
    for layout, diffs in result["layouts"].items():
        assert diffs["loss"] <= LOSS_RTOL, f"{kind} {layout}: loss differs by {diffs['loss']:.2e} (seed={seed})"
        for name, value in diffs.items():
            assert value <= GRAD_RTOL, f"{kind} {layout}: {name} differs by {value:.2e} relative (seed={seed})"


@pytest.mark.parametrize("kind", ["full", "sparse"])
def test_packed_model_matches_reference_backend(packed_report, kind):
    seed, report = packed_report
    result = report[kind]
    assert isinstance(result, dict), f"the run failed (seed={seed}):\n{result}"
    for name, value in result["reference backend"].items():
        assert value <= GRAD_RTOL, f"{kind}: {name} differs from the reference oracle by {value:.2e} (seed={seed})"
    # the same batch without the documents: the gradients move by ~1 (relative), far beyond the tolerances; the
    # summed loss of a randomly initialised model moves by as little as 4e-6, too close to LOSS_RTOL to test
    gradients = {name: value for name, value in result["unmasked"].items() if name != "loss"}
    assert max(gradients.values()) > 1e3 * GRAD_RTOL, f"{kind}: the document mask left the gradients (seed={seed})"


def test_one_document_is_bitwise_the_unpacked_path(packed_report):
    seed, report = packed_report
    assert report["one document"] == {"cp1": True, "cp2": True}, f"{report['one document']} (seed={seed})"


def test_recompute_reuses_the_per_document_index(packed_report):
    seed, report = packed_report
    assert report["recompute"]["estimations"] == [1, 1], f"{report['recompute']} (seed={seed})"
    for name, value in report["recompute"]["diffs"].items():
        assert value <= GRAD_RTOL, f"recomputation changed {name} by {value:.2e} (seed={seed})"


def test_per_token_rope_uses_document_positions(packed_report):
    seed, report = packed_report
    assert report["rope"] == 0.0, f"per-token RoPE differs from the table rows by {report['rope']} (seed={seed})"


def test_packed_statistics(packed_report):
    """Density (listed work over every document dense), documents per sequence and balance are kept for packed
    layers and reach the step metrics."""
    seed, report = packed_report
    stats = report["statistics"]
    expected = stats["expected documents per sequence"]
    for kind in ("full", "sparse"):
        layers = stats[kind]
        assert layers["layers"] >= 1, f"{kind}: no packed layer kept statistics (seed={seed})"
        assert layers["documents per sequence"] == [expected] * layers["layers"], f"{kind}: {layers} (seed={seed})"
        assert all(imbalance >= 1.0 for imbalance in layers["worker imbalance"]), f"{kind}: {layers} (seed={seed})"
        documents, clamped, density = layers["metrics"]
        assert documents == expected and clamped == 0, f"{kind}: step metrics {layers['metrics']} (seed={seed})"
        assert density == pytest.approx(sum(layers["density"]) / layers["layers"]), f"{kind} (seed={seed})"
    assert stats["full"]["density"] == [1.0] * stats["full"]["layers"], f"{stats['full']} (seed={seed})"
    assert all(0.0 < d < 1.0 for d in stats["sparse"]["density"]), f"{stats['sparse']} (seed={seed})"


def test_packed_documents_refusals(packed_report):
    _, report = packed_report
    refusals = report["refusals"]
    assert "--mtraining-dense-impl=sdpa_cudnn has no document mask" in refusals["sdpa"]
    assert "PackedSeqParams" in refusals["thd"] and "PackedDocuments" in refusals["thd"]
    assert "build them from this micro-batch" in refusals["other batch"]


def test_min_sparse_length_flag_and_bounds():
    import argparse

    from megatron_mtraining.arguments import add_mtraining_args, mtraining_config_from_args
    from megatron_mtraining.config import DEFAULT_MIN_SPARSE_LENGTH, MTrainingConfig

    parser = add_mtraining_args(argparse.ArgumentParser())
    assert mtraining_config_from_args(parser.parse_args([])).min_sparse_length == DEFAULT_MIN_SPARSE_LENGTH
    given = parser.parse_args(["--mtraining-min-sparse-length", "8192"])
    assert mtraining_config_from_args(given).min_sparse_length == 8192
    with pytest.raises(ValueError, match=r"--mtraining-min-sparse-length=99 must be an integer >= max\(.*\) = 100"):
        MTrainingConfig(min_sparse_length=99)
    with pytest.raises(ValueError, match="--mtraining-min-sparse-length=120 .* = 128"):
        MTrainingConfig(min_sparse_length=120, local_window=128)
    assert MTrainingConfig(min_sparse_length=64, local_window=1).min_sparse_length == 64

"""Document boundaries of a batch of packed sequences (PACKED.md).

A packed sequence of N tokens is the concatenation of documents D_1 … D_m starting at
0 = o_1 < o_2 < … < o_m. :class:`Documents` stores the starts and builds the per-token views the
attention, the estimator and RoPE need once, when it is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _check_positive_int(name: str, value, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer ({meaning})")


def _check_integer_tensor(name: str, tensor, dims: int, layout: str) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dims:
        raise ValueError(
            f"{name} must be a {dims}-D integer tensor {layout}, got "
            f"{type(tensor).__name__} of shape {tuple(getattr(tensor, 'shape', ()))}"
        )
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype (int32 or int64), got {tensor.dtype}; convert it first")
    if tensor.numel() == 0:
        raise ValueError(f"{name} {layout} must not be empty, got shape {tuple(tensor.shape)}")


def _starts_from_flags(is_start: torch.Tensor) -> torch.Tensor:
    """Starts int64 ``[b, m_max]`` from bool ``is_start [b, N]`` (True at every document start)."""
    seq_len = is_start.shape[1]
    positions = torch.arange(seq_len, device=is_start.device).expand_as(is_start)
    max_documents = int(is_start.sum(dim=1).max())
    return torch.where(is_start, positions, seq_len).sort(dim=1).values[:, :max_documents].contiguous()


@dataclass(frozen=True, eq=False)
class Documents:
    """Document boundaries of ``b`` packed sequences of ``seq_len`` tokens.

    ``starts`` int64 ``[b, m_max]``: per sample, the ascending document starts, ``starts[:, 0] == 0``,
    unused slots hold ``seq_len`` (a sample with fewer than m_max documents). Derived views, built once:

    * ``doc_id`` int32 ``[b, N]``: the document of every token, numbered 0 … within its sample;
    * ``lengths`` int64 ``[b, m_max]``: document lengths, 0 in unused slots;
    * ``num_documents`` int64 ``[b]``;
    * ``position_ids`` int64 ``[b, N]``: position within the document, 0 at every start (RoPE with
      Megatron's ``--reset-position-ids``);
    * ``host_spans`` int64 ``[b, m_max, 2]`` on the CPU: (start, length) of every slot, copied once, so that
      the per-layer code that loops over documents reads them without a device sync.
    """

    starts: torch.Tensor
    seq_len: int
    doc_id: torch.Tensor = field(init=False, repr=False)
    lengths: torch.Tensor = field(init=False, repr=False)
    num_documents: torch.Tensor = field(init=False, repr=False)
    position_ids: torch.Tensor = field(init=False, repr=False)
    host_spans: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        seq_len = self.seq_len
        _check_positive_int("seq_len", seq_len, "the tokens per sample")
        _check_integer_tensor("starts", self.starts, 2, "[b, m_max]")
        starts = self.starts.long()
        object.__setattr__(self, "starts", starts)
        first = starts[:, 0]
        if (first != 0).any():
            sample = int((first != 0).nonzero()[0])
            raise ValueError(
                f"starts[{sample}, 0]={int(first[sample])}: every sample's first document must start at 0; "
                "put 0 in the first slot of every row"
            )
        outside = (starts < 0) | (starts > seq_len)
        if outside.any():
            sample, slot = (int(x) for x in outside.nonzero()[0])
            raise ValueError(
                f"starts[{sample}, {slot}]={int(starts[sample, slot])} is outside [0, seq_len={seq_len}); "
                f"document starts lie in [0, {seq_len - 1}] and unused slots hold seq_len={seq_len}"
            )
        previous, following = starts[:, :-1], starts[:, 1:]
        disordered = (following <= previous) & (following < seq_len)  # only padding may follow padding
        if disordered.any():
            sample, slot = (int(x) for x in disordered.nonzero()[0])
            raise ValueError(
                f"starts[{sample}] = {starts[sample].tolist()} is not strictly ascending at slot {slot + 1} "
                f"({int(following[sample, slot])} after {int(previous[sample, slot])}); list each document start "
                f"once, in ascending order, then pad with seq_len={seq_len}"
            )

        ends = torch.cat([following, torch.full_like(first, seq_len)[:, None]], dim=1)
        is_start = torch.zeros(starts.shape[0], seq_len + 1, dtype=torch.int32, device=starts.device)
        is_start.scatter_(1, starts, 1)  # unused slots mark the spare column seq_len
        doc_id = is_start[:, :seq_len].cumsum(dim=1, dtype=torch.int32) - 1
        positions = torch.arange(seq_len, device=starts.device)
        object.__setattr__(self, "doc_id", doc_id)
        object.__setattr__(self, "lengths", ends - starts)
        object.__setattr__(self, "host_spans", torch.stack([starts, self.lengths], dim=-1).cpu())
        object.__setattr__(self, "num_documents", (starts < seq_len).sum(dim=1))
        object.__setattr__(self, "position_ids", positions - starts.gather(1, doc_id.long()))

    @property
    def batch_size(self) -> int:
        return self.starts.shape[0]

    @property
    def max_documents(self) -> int:
        """m_max, the slots per sample."""
        return self.starts.shape[1]

    @classmethod
    def single(cls, batch: int, seq_len: int, device=None) -> Documents:
        """One document spanning each of ``batch`` samples."""
        _check_positive_int("batch", batch, "the samples")
        return cls(torch.zeros(batch, 1, dtype=torch.int64, device=device), seq_len)

    @classmethod
    def from_eod(cls, tokens: torch.Tensor, eod_token: int) -> Documents:
        """Boundaries of token ids ``tokens [b, N]`` as Megatron draws them with ``--reset-attention-mask``.

        An EOD token ends the document it belongs to and the next token starts a new one; an EOD in the
        last position starts nothing (``megatron.core.datasets.gpt_dataset._get_ltor_masks_and_position_ids``).
        """
        _check_integer_tensor("tokens", tokens, 2, "[b, N]")
        if isinstance(eod_token, bool) or not isinstance(eod_token, int):
            raise ValueError(f"eod_token={eod_token!r} must be an integer token id (the tokenizer's eod)")
        is_start = torch.ones_like(tokens, dtype=torch.bool)
        is_start[:, 1:] = tokens[:, :-1] == eod_token
        return cls(_starts_from_flags(is_start), tokens.shape[1])

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, seq_len: int) -> Documents:
        """Boundaries of one sample from cumulative lengths ``cu_seqlens [m + 1]`` (Megatron's THD
        ``PackedSeqParams.cu_seqlens_q``): ``cu_seqlens[0] == 0``, strictly increasing, ending at ``seq_len``."""
        _check_positive_int("seq_len", seq_len, "the tokens of the sample")
        _check_integer_tensor("cu_seqlens", cu_seqlens, 1, "[m + 1]")
        if cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0:
            raise ValueError(
                f"cu_seqlens={cu_seqlens.tolist()} must start with 0 and hold at least one document "
                f"(e.g. [0, {seq_len}] for a single one)"
            )
        steps = cu_seqlens[1:] - cu_seqlens[:-1]
        if (steps <= 0).any():
            slot = int((steps <= 0).nonzero()[0]) + 1
            raise ValueError(
                f"cu_seqlens={cu_seqlens.tolist()} is not strictly increasing at entry {slot} "
                f"({int(cu_seqlens[slot])} after {int(cu_seqlens[slot - 1])}); every document needs at least one token"
            )
        if int(cu_seqlens[-1]) != seq_len:
            raise ValueError(
                f"cu_seqlens ends at {int(cu_seqlens[-1])} but seq_len={seq_len}; the documents must cover the "
                f"sequence exactly (use the unpadded cu_seqlens of a sample of {seq_len} tokens)"
            )
        return cls(cu_seqlens[None, :-1], seq_len)

    @classmethod
    def from_padded_cu_seqlens(cls, cu_seqlens: torch.Tensor, seq_len: int) -> Documents:
        """Boundaries of ``b`` samples from Megatron's dataloader ``cu_seqlens [b, L]`` (GPTDataset with
        ``--dataloader-inter-document-masking``): per row 0, the ascending document ends, then ``seq_len``
        repeated as padding. One host sync (the most documents of a sample)."""
        _check_positive_int("seq_len", seq_len, "the tokens of a sample")
        _check_integer_tensor("cu_seqlens", cu_seqlens, 2, "[b, L]")
        if cu_seqlens.shape[1] < 2:
            raise ValueError(f"cu_seqlens {tuple(cu_seqlens.shape)} needs at least [0, seq_len] per sample")
        ends = cu_seqlens[:, 1:]
        steps = ends - cu_seqlens[:, :-1]
        bad = (cu_seqlens[:, 0] != 0) | (cu_seqlens[:, -1] != seq_len) | ((steps <= 0) & (ends < seq_len)).any(1)
        bad |= (steps < 0).any(1) | (cu_seqlens > seq_len).any(1)
        if bad.any():
            sample = int(bad.nonzero()[0])
            raise ValueError(
                f"cu_seqlens[{sample}]={cu_seqlens[sample].tolist()} must be 0, strictly increasing document ends "
                f"and then {seq_len} (the sample's length) repeated"
            )
        is_start = torch.zeros(cu_seqlens.shape[0], seq_len + 1, dtype=torch.bool, device=cu_seqlens.device)
        is_start.scatter_(1, cu_seqlens.long(), True)
        return cls(_starts_from_flags(is_start[:, :seq_len]), seq_len)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> Documents:
        """Boundaries from per-document positions ``position_ids [b, N]`` (0, 1, 2, … restarting at 0 at every
        document start, as Megatron builds them with ``--reset-position-ids``)."""
        _check_integer_tensor("position_ids", position_ids, 2, "[b, N]")
        is_start = position_ids == 0
        is_start[:, 0] = True  # every sample starts a document; a nonzero first position is reported below
        documents = cls(_starts_from_flags(is_start), position_ids.shape[1])
        wrong = documents.position_ids != position_ids
        if wrong.any():
            sample, position = (int(x) for x in wrong.nonzero()[0])
            raise ValueError(
                f"position_ids[{sample}, {position}]={int(position_ids[sample, position])} should be "
                f"{int(documents.position_ids[sample, position])}: positions must count 0, 1, 2, … from the start of "
                "the sample and from every later 0 (a document start)"
            )
        return documents

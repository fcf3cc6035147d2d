"""Synthetic long-context data: multi-key key→value retrieval in a haystack of synthetic text.

A sequence of ``N`` tokens is ``BOS``, a haystack, then a block of queries::

    BOS  f f f KV k v1 v2 f f f f ... KV k' v1' v2' f f f ... f f   Q k v1 v2  Q k' v1' v2' ...
         |<------------------------ haystack --------------------->|<---- query block ---->|

* **Needles.** ``num_pairs`` key→value pairs ``KV k_1…k_K v_1…v_V`` replace filler at random,
  non-overlapping positions. Keys are distinct within a sequence; every pair except the queried ones
  is a distractor.
* **Values.** With ``key_specific_values`` (the default) answer slot i of key k takes one of
  ``value_choices`` tokens reserved for (k, i), so one attention layer can retrieve each answer token
  by content (from the query key or the previous answer token to the needle's token): small models
  learn it in a few hundred steps. Without it, every value token comes from one shared alphabet of
  ``value_choices`` tokens and retrieval needs an induction circuit (a previous-token head composed
  with a matching head), which small models learn far more slowly.
* **Queries.** The query block asks ``num_queries`` distinct pairs: ``Q k_1…k_K`` followed by the
  answer ``v_1…v_V`` (teacher-forced). Keep the block inside the last 64 tokens, the rows MTraining's
  estimator reads (the defaults: 8 queries of 4 tokens).
* **Filler (plain language modelling).** ``filler="walks"``: two interleaved random walks over the
  filler ids (t[i+2] = t[i] + δ mod F, δ from a fixed distribution over 1 … 4), a fixed "language" whose
  prediction needs the token two back (previous-token heads); its loss floor is the entropy of δ.
  ``filler="phrases"``: each sequence draws ``phrases`` random words of ``phrase_len`` tokens and
  writes the haystack as a random sequence of them, so predicting a word's continuation needs
  in-context copying from anywhere in the context.

Loss covers every token; :attr:`Batch.answer_mask` marks the label positions whose target is an answer
token. A query is answered correctly when every answer token is the argmax at its teacher-forced
position (the same as an exact match of greedy decoding). Batches are deterministic per (seed,
stream, index, length, depth).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAD, BOS, KV, QUERY = 0, 1, 2, 3
NUM_SPECIAL = 8  # ids 0 … 7 are reserved for markers
FILLERS = ("walks", "phrases")
WALK_STEP_PROBS = (0.5, 0.25, 0.15, 0.1)  # δ = 1, 2, 3, 4 of the random-walk filler


@dataclass(frozen=True)
class RetrievalTask:
    """Vocabulary layout (ids: specials, keys, values, filler) and sequence format."""

    vocab_size: int = 1024
    key_alphabet: int = 16
    key_len: int = 1
    value_len: int = 2
    value_choices: int = 16
    key_specific_values: bool = True
    num_pairs: int = 12
    num_queries: int = 8
    filler: str = "walks"
    phrases: int = 32
    phrase_len: int = 6

    def __post_init__(self) -> None:
        for name in (
            "key_alphabet",
            "key_len",
            "value_len",
            "value_choices",
            "num_pairs",
            "num_queries",
            "phrases",
            "phrase_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.filler not in FILLERS:
            raise ValueError(f"filler={self.filler!r} is unknown; use one of {FILLERS}")
        if self.key_specific_values and self.key_len != 1:
            raise ValueError(
                f"key_specific_values reserves value tokens per key token, so it needs key_len=1, "
                f"got key_len={self.key_len}; use key_len=1 or key_specific_values=False"
            )
        if self.value_choices < 2:
            raise ValueError(f"value_choices={self.value_choices} leaves nothing to retrieve; use >= 2")
        if self.filler_alphabet < 2 * len(WALK_STEP_PROBS):
            needed = self.filler_base + 2 * len(WALK_STEP_PROBS)
            raise ValueError(
                f"vocab_size={self.vocab_size} leaves {self.filler_alphabet} filler ids after "
                f"{NUM_SPECIAL} specials, {self.key_alphabet} keys and {self.value_alphabet} values; "
                f"use vocab_size >= {needed} or fewer keys/values"
            )
        if self.num_queries > self.num_pairs:
            raise ValueError(
                f"num_queries={self.num_queries} exceeds num_pairs={self.num_pairs}; every query asks a "
                "different pair, so use num_queries <= num_pairs"
            )
        if self.key_alphabet**self.key_len < self.num_pairs:
            raise ValueError(
                f"key_alphabet**key_len={self.key_alphabet**self.key_len} distinct keys cannot cover "
                f"num_pairs={self.num_pairs}; raise key_alphabet or key_len"
            )

    # ------------------------------------------------------------------ layout
    @property
    def key_base(self) -> int:
        return NUM_SPECIAL

    @property
    def value_base(self) -> int:
        return NUM_SPECIAL + self.key_alphabet

    @property
    def value_alphabet(self) -> int:
        if self.key_specific_values:
            return self.key_alphabet * self.value_len * self.value_choices
        return self.value_choices

    @property
    def filler_base(self) -> int:
        return self.value_base + self.value_alphabet

    @property
    def filler_alphabet(self) -> int:
        return self.vocab_size - self.filler_base

    @property
    def pair_len(self) -> int:
        """Tokens of one needle ``KV k… v…`` (and of one query with its answer)."""
        return 1 + self.key_len + self.value_len

    @property
    def query_block_len(self) -> int:
        return self.num_queries * self.pair_len

    def haystack_len(self, seq_len: int) -> int:
        return seq_len - 1 - self.query_block_len

    def check_length(self, seq_len: int) -> None:
        """Raise unless ``seq_len`` fits the needles with room to spare (at least twice their tokens)."""
        needed = 2 * self.num_pairs * self.pair_len
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or self.haystack_len(seq_len) < needed:
            raise ValueError(
                f"seq_len={seq_len!r} leaves a haystack of {self.haystack_len(seq_len)} tokens; "
                f"{self.num_pairs} needles of {self.pair_len} tokens need >= {needed}; use seq_len >= "
                f"{needed + 1 + self.query_block_len} or fewer pairs"
            )

    def values_of(self, key_index: int, choices: np.ndarray) -> np.ndarray:
        """Value tokens ``[V]`` of a key (its index in the key alphabet; key_len 1) for per-slot ``choices [V]``."""
        if not self.key_specific_values:
            return self.value_base + choices
        slots = np.arange(self.value_len)
        return self.value_base + (key_index * self.value_len + slots) * self.value_choices + choices

    # ------------------------------------------------------------------ generation
    def sequence(self, rng: np.random.Generator, seq_len: int, target_depth: float | None = None) -> dict:
        """One sequence: ``tokens [N]`` int64, ``answer_spans`` (label position of each query's first answer
        token, in query order), ``target`` (index of the depth-controlled query, or None), ``needle_starts``.

        With ``target_depth`` in [0, 1], pair 0 starts at offset round(depth · (H − pair_len)) of the
        haystack (H tokens, so token 1 + offset) and is asked by the last query; otherwise every pair is
        placed at random.
        """
        self.check_length(seq_len)
        if target_depth is not None and not 0.0 <= target_depth <= 1.0:
            raise ValueError(f"target_depth={target_depth!r} must be in [0, 1]")
        haystack = self.haystack_len(seq_len)
        tokens = np.empty(seq_len, dtype=np.int64)
        tokens[0] = BOS
        tokens[1 : 1 + haystack] = self._filler(rng, haystack)

        starts = 1 + self._needle_starts(rng, haystack, target_depth)
        codes = rng.choice(self.key_alphabet**self.key_len, size=self.num_pairs, replace=False)
        pairs = []
        for start, code in zip(starts, codes):
            key = self.key_base + np.array(
                [(code // self.key_alphabet**i) % self.key_alphabet for i in reversed(range(self.key_len))]
            )
            value = self.values_of(int(code), rng.integers(self.value_choices, size=self.value_len))
            pair = np.concatenate([key, value])
            tokens[start : start + self.pair_len] = np.concatenate([[KV], pair])
            pairs.append(pair)

        asked = rng.choice(self.num_pairs, size=self.num_queries, replace=False)
        target = None
        if target_depth is not None:
            asked = np.concatenate([asked[asked != 0][: self.num_queries - 1], [0]])
            target = self.num_queries - 1
        answer_spans = []
        position = 1 + haystack
        for pair in asked:
            tokens[position : position + self.pair_len] = np.concatenate([[QUERY], pairs[pair]])
            # label t is token t+1: the first answer token is predicted at the last key token
            answer_spans.append(position + self.key_len)
            position += self.pair_len
        return {"tokens": tokens, "answer_spans": answer_spans, "target": target, "needle_starts": starts}

    def _filler(self, rng: np.random.Generator, length: int) -> np.ndarray:
        if self.filler == "phrases":
            words = rng.integers(self.filler_alphabet, size=(self.phrases, self.phrase_len))
            order = rng.integers(self.phrases, size=-(-length // self.phrase_len))
            return self.filler_base + words[order].reshape(-1)[:length]
        steps = rng.choice(len(WALK_STEP_PROBS), size=length, p=WALK_STEP_PROBS) + 1
        walks = np.empty(length, dtype=np.int64)
        first, second = rng.integers(self.filler_alphabet, size=2)
        walks[0::2] = first + np.cumsum(steps[0::2])
        walks[1::2] = second + np.cumsum(steps[1::2])
        return self.filler_base + walks % self.filler_alphabet

    def _needle_starts(self, rng: np.random.Generator, haystack: int, target_depth: float | None) -> np.ndarray:
        """Haystack offsets of the ``num_pairs`` needles, non-overlapping; needle 0 at the target depth if given."""
        length = self.pair_len
        starts: list[int] = []
        if target_depth is not None:
            starts.append(int(round(target_depth * (haystack - length))))
        while len(starts) < self.num_pairs:  # the haystack is at least twice the needles
            candidate = int(rng.integers(haystack - length + 1))
            if all(abs(candidate - start) >= length for start in starts):
                starts.append(candidate)
        return np.array(starts, dtype=np.int64)

    def batch(
        self, seed: int, stream: int, index: int, batch_size: int, seq_len: int, target_depth: float | None = None
    ) -> "Batch":
        """Batch ``index`` of stream ``stream`` (e.g. 0 = training, 1 = evaluation): the same for the same arguments."""
        depth_code = 0 if target_depth is None else 1 + int(round(target_depth * 1e6))
        rng = np.random.default_rng([seed, stream, index, seq_len, depth_code])
        sequences = [self.sequence(rng, seq_len, target_depth) for _ in range(batch_size)]
        return Batch.from_sequences(sequences, self.value_len)


@dataclass(frozen=True)
class Batch:
    """``tokens``/``labels`` int64 ``[b, N]`` (label t = token t+1, last label PAD with weight 0);
    ``loss_mask``/``answer_mask`` float ``[b, N]``; ``answer_slots [b, Q, V]`` label positions of each
    query's answer tokens; ``target`` the depth-controlled query's index or −1."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    answer_mask: torch.Tensor
    answer_slots: torch.Tensor
    target: int

    @classmethod
    def from_sequences(cls, sequences: list[dict], value_len: int) -> "Batch":
        tokens = torch.from_numpy(np.stack([s["tokens"] for s in sequences]))
        labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], PAD)], dim=1)
        loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
        loss_mask[:, -1] = 0.0
        slots = torch.tensor([s["answer_spans"] for s in sequences])[..., None] + torch.arange(value_len)
        answer_mask = torch.zeros_like(loss_mask).scatter_(1, slots.flatten(1), 1.0)
        target = sequences[0]["target"]
        return cls(tokens, labels, loss_mask, answer_mask, slots, -1 if target is None else target)

    def to(self, device) -> "Batch":
        return Batch(
            self.tokens.to(device),
            self.labels.to(device),
            self.loss_mask.to(device),
            self.answer_mask.to(device),
            self.answer_slots.to(device),
            self.target,
        )


def query_correct(predictions: torch.Tensor, labels: torch.Tensor, answer_slots: torch.Tensor) -> torch.Tensor:
    """Bool ``[b, Q]``: every answer token of the query is predicted (``predictions``/``labels [b, N]``)."""
    flat = answer_slots.flatten(1)
    hits = predictions.gather(1, flat) == labels.gather(1, flat)
    return hits.view(answer_slots.shape).all(dim=-1)

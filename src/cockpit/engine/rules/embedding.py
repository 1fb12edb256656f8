"""Embeddings: g_n(W) = Σ_t e_{i_{n,t}} δ_{n,t}ᵀ, a sparse matrix with one row per distinct
token of sample n.

Rows of repeated tokens within a sample are summed first (``index_add`` into one slot per
distinct (sample, token) pair, found by sorting the keys: no read of the device), so every
statistic is exact and no N×V×E tensor is ever built: ‖g_n‖² sums the squared rows of sample
n, g_nᵀU sums ⟨row, U[token]⟩, Σ_n g_n⊙g_n adds the squared rows into their tokens, and the
histogram counts the slots' elements plus the N·V·E − P·E exact zeros (P = N·T slots, the
unused ones zero rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from cockpit.engine.dtypes import in_dtype
from cockpit.engine.histograms.exact import BinSpec, histogram2d_dense, histogram_dense_counts
from cockpit.engine.rules.registry import register_rule
from cockpit.engine.rules.sample_grads import SampleGrads, stack_or_view


class EmbeddingSampleGrads(SampleGrads):
    """The rows of g_n, one slot per (sample, position): slot k holds the sum of δ over the
    positions of sample ``pair_sample[k]`` that look up token ``pair_token[k]``, in the
    sorted order of the keys n·V + token. A pair seen several times fills one slot, the
    others stay zero rows (assigned to the last sample's last token, which keeps the slots
    sorted): the slots are as many as the positions, known without reading the device (the
    distinct pairs' number would be a wait on a GPU), and zero rows add nothing to a sum.

    The slots are formed when a question that is not linear in g_n first needs them (norms,
    histograms, sums of squares); projections are linear, g_nᵀu = Σ_t ⟨δ_{n,t}, u[i_{n,t}]⟩,
    and read the positions' rows as they are (no sort)."""

    selectable = True

    def __init__(self, indices: Tensor, delta: Tensor, num_embeddings: int, padding_idx):
        n = indices.shape[0]
        idx = indices.reshape(n, -1)
        rows = delta.reshape(idx.numel(), -1)
        if padding_idx is not None:
            rows = rows * (idx != padding_idx).reshape(-1, 1)
        # each position's row and its token [N, T] (None where only slots are held)
        self._by_position: tuple[Tensor, Tensor] | None = (rows, idx)
        self._slots: tuple[Tensor, Tensor, Tensor] | None = None
        self.num_samples = n
        self.shape = torch.Size((num_embeddings, rows.shape[-1]))

    @classmethod
    def from_positions(cls, sample: Tensor, token: Tensor, rows: Tensor, num_samples: int,
                       num_embeddings: int) -> EmbeddingSampleGrads:
        """g_n = Σ_{k: sample[k] = n} e_{token[k]} rows[k]ᵀ for positions k in any order and
        any number per sample (the bags of an nn.EmbeddingBag)."""
        grads = cls.__new__(cls)
        grads._by_position = None
        grads.num_samples = num_samples
        grads.shape = torch.Size((num_embeddings, rows.shape[-1]))
        grads._slots = _slots(rows, sample * num_embeddings + token, num_samples,
                              num_embeddings)
        return grads

    def _grouped(self) -> tuple[Tensor, Tensor, Tensor]:
        """(rows, pair_sample, pair_token) of the slots, formed once."""
        if self._slots is None:
            assert self._by_position is not None
            rows, idx = self._by_position
            n, vocab = self.num_samples, self.shape[0]
            sample = torch.arange(0, n * vocab, vocab, device=idx.device)
            self._slots = _slots(rows, (idx + sample.unsqueeze(1)).reshape(-1), n, vocab)
        return self._slots

    @property
    def rows(self) -> Tensor:
        return self._grouped()[0]

    @property
    def pair_sample(self) -> Tensor:
        return self._grouped()[1]

    @property
    def pair_token(self) -> Tensor:
        return self._grouped()[2]

    def _any_rows(self) -> Tensor:
        """The positions' rows or the slots' (as many, the same dtype), without grouping."""
        return self._by_position[0] if self._by_position is not None else self.rows

    @property
    def dtype(self) -> torch.dtype:
        return self._any_rows().dtype

    def select(self, start: int, stop: int) -> SampleGrads:
        """Samples start ≤ n < stop: the pairs of the other samples become zero rows (the
        bounds of the samples' run of sorted pairs would be a read of the device; a zero
        row adds nothing, and a non-finite value of another sample does not leak in)."""
        inside = (self.pair_sample >= start) & (self.pair_sample < stop)
        part = EmbeddingSampleGrads.__new__(EmbeddingSampleGrads)
        part._by_position = None
        part._slots = (torch.where(inside.unsqueeze(1), self.rows, 0), (
            self.pair_sample - start).clamp_(0, stop - start - 1), self.pair_token)
        part.num_samples, part.shape = stop - start, self.shape
        return part

    def materialize(self) -> Tensor:
        dense = self.rows.new_zeros(self.num_samples, *self.shape)
        # (accumulate: the zero rows of unused slots share one index)
        return dense.index_put_((self.pair_sample, self.pair_token), self.rows, accumulate=True)

    adds_sparsely = True

    def add_to(self, total: Tensor) -> None:
        """The slots' rows added into their (sample, token) rows of ``total``: no dense G
        (GPT-2's tied embedding: 154 MB a sample written as zeros, then read to be added)."""
        total.index_put_((self.pair_sample, self.pair_token), in_dtype(self.rows, total.dtype),
                         accumulate=True)

    def sq_norms(self) -> Tensor:
        out = self.rows.new_zeros(self.num_samples)
        return out.index_add_(0, self.pair_sample, self.rows.pow(2).sum(1))

    def batch_mean(self) -> Tensor:
        out = self.rows.new_zeros(self.shape)
        return out.index_add_(0, self.pair_token, self.rows) / self.num_samples

    def dots(self, u: Tensor) -> Tensor:
        weight = in_dtype(u.reshape(self.shape), self.dtype)
        if self._by_position is not None:  # Σ_t ⟨δ_{n,t}, u[i_{n,t}]⟩
            rows, idx = self._by_position
            return (rows.reshape(*idx.shape, -1) * weight[idx]).sum((1, 2))
        per_pair = (self.rows * weight[self.pair_token]).sum(1)
        return self.rows.new_zeros(self.num_samples).index_add_(0, self.pair_sample, per_pair)

    def dots_many(self, us: Sequence[Tensor]) -> Tensor:
        return stack_or_view([self.dots(u) for u in us])

    def dots_scratch_bytes(self, num_directions: int) -> int:
        """One direction's rows at the positions at a time (no individual gradients)."""
        rows = self._any_rows()
        return 2 * rows.numel() * rows.element_size()

    def sum_sq(self) -> Tensor:
        rows = self.rows.double()
        return rows.new_zeros(self.shape).index_add_(0, self.pair_token, rows.pow(2))

    def centered_sum_sq(self) -> Tensor:
        # rows absent from a sample are zeros: Σ_n (g_n − ḡ)² = Σ_n g_n² − N ḡ², with ḡ and
        # the sums in float64
        mean = self.batch_mean().double()
        return self.sum_sq() - self.num_samples * mean.pow(2)

    def _num_implicit_zeros(self) -> int:
        return (self.num_samples * self.shape[0] - self.rows.shape[0]) * self.shape[1]

    def histogram(self, spec: BinSpec) -> Tensor:
        counts = histogram_dense_counts([self.rows], spec)
        zero_bin = histogram_dense_counts([self.rows.new_zeros(1)], spec)
        return counts + zero_bin * self._num_implicit_zeros()

    def histogram2d(self, theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec) -> Tensor:
        theta_rows = theta.reshape(self.shape)[self.pair_token]
        explicit = histogram2d_dense(self.rows.reshape(1, -1), theta_rows.reshape(-1),
                                     spec_g, spec_theta)[0]
        # every sample pairs each parameter with a zero gradient, except at its own rows
        all_zero = histogram2d_dense(theta.new_zeros(1, theta.numel()), theta.reshape(-1),
                                     spec_g, spec_theta)[0] * self.num_samples
        own_zero = histogram2d_dense(theta_rows.new_zeros(1, theta_rows.numel()),
                                     theta_rows.reshape(-1), spec_g, spec_theta)[0]
        return explicit + all_zero - own_zero


def _slots(rows: Tensor, keys: Tensor, n: int, vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    """(rows, pair_sample, pair_token) of the slots of positions with ``rows`` [P, E] and
    ``keys`` [P] = sample · V + token (see :class:`EmbeddingSampleGrads`)."""
    keys, order = torch.sort(keys)
    # slot of each sorted key: the number of distinct keys before it
    first = torch.ones_like(keys, dtype=torch.int64)
    torch.ne(keys[1:], keys[:-1], out=first[1:])
    slot = first.cumsum_(0).sub_(1)
    slot_rows = rows.new_zeros(rows.shape).index_add_(0, slot, rows[order])
    slot_keys = torch.full_like(keys, n * vocab - 1).scatter_(0, slot, keys)
    return slot_rows, slot_keys // vocab, slot_keys % vocab


@register_rule(nn.Embedding)
def embedding_rule(
    module: nn.Embedding, args: tuple, kwargs: dict, output: Tensor, grad_output: Tensor
) -> dict[str, SampleGrads]:
    if module.scale_grad_by_freq:
        raise ValueError(
            "Embedding with scale_grad_by_freq=True scales gradients by token counts of the "
            "whole batch, which mixes samples: individual gradients are undefined. "
            "Set scale_grad_by_freq=False to use per-sample instruments."
        )
    if not module.weight.requires_grad:
        return {}
    indices = args[0] if args else kwargs["input"]
    grads = EmbeddingSampleGrads(indices, grad_output, module.num_embeddings, module.padding_idx)
    return {"weight": grads}


_BAG_MODES = {"sum": 0, "mean": 1, "max": 2}


def embedding_bag_rule(module: nn.EmbeddingBag, args: tuple, kwargs: dict,
                       grad_output: Tensor, weight: Tensor) -> dict[str, SampleGrads]:
    """Individual gradients of nn.EmbeddingBag, one sample per bag (output row n):

    * ``sum``:  g_n = Σ_{t ∈ bag n} w_t e_{i_t} δ_nᵀ (w_t the ``per_sample_weights``, else 1),
    * ``mean``: g_n = (1/L_n) Σ_{t ∈ bag n} e_{i_t} δ_nᵀ, L_n the bag's entries,
    * ``max``:  g_n[i, j] = δ_{n,j} where token i holds the bag's maximum of column j,

    entries equal to ``padding_idx`` left out (as in the layer) and an empty bag's g_n zero.
    The input is 2-D [N, L] (bags of equal length) or 1-D with ``offsets`` (bag n starts at
    offsets[n]; with ``include_last_offset`` the last offset ends the last bag). ``weight``:
    the table the call used (max mode reads it to find the maxima: the parameter the
    general path keeps for the call, not the updated one)."""
    if module.scale_grad_by_freq:
        raise ValueError(
            "EmbeddingBag with scale_grad_by_freq=True scales gradients by token counts of "
            "the whole batch, which mixes samples: individual gradients are undefined. "
            "Set scale_grad_by_freq=False to use per-sample instruments."
        )
    names = ("input", "offsets", "per_sample_weights")
    given = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items()
                                                    if k in names}
    indices, offsets = given["input"], given.get("offsets")
    psw = given.get("per_sample_weights")
    include_last = module.include_last_offset
    if indices.dim() == 2:  # bags of equal length: the layer's own conversion
        offsets = torch.arange(0, indices.numel(), indices.shape[1], device=indices.device)
        include_last = False
        indices = indices.reshape(-1)
        psw = None if psw is None else psw.reshape(-1)
    elif indices.dim() != 1 or offsets is None:
        raise ValueError(
            f"EmbeddingBag received an input of shape {tuple(indices.shape)}; Cockpit needs "
            "a 2-D input [batch, bag length] or a 1-D input with offsets")
    starts = offsets[:-1] if include_last else offsets
    n, vocab = grad_output.shape[0], module.num_embeddings
    if starts.shape[0] != n:  # (the engine checks the bags against the losses first)
        raise ValueError("internal: EmbeddingBag's bags do not match its output")
    positions = torch.arange(indices.shape[0], device=indices.device)
    bag = torch.searchsorted(starts.to(indices.dtype), positions, right=True) - 1
    keep = torch.ones_like(indices, dtype=torch.bool)
    if include_last:
        keep &= positions < offsets[-1]
    if module.padding_idx is not None:
        keep &= indices != module.padding_idx
    if module.mode == "max":
        with torch.no_grad():
            _, _, bag_size, max_indices = torch.embedding_bag(
                weight, indices, offsets, False, _BAG_MODES["max"], False, None,
                include_last, module.padding_idx)
        # one position per (bag, column) j: the row δ_{n,j} e_jᵀ at its maximal token
        emb = grad_output.shape[1]
        rows = torch.diag_embed(grad_output * (bag_size > 0).unsqueeze(1).to(grad_output.dtype))
        return {"weight": EmbeddingSampleGrads.from_positions(
            torch.arange(n, device=indices.device).repeat_interleave(emb),
            max_indices.reshape(-1), rows.reshape(n * emb, emb), n, vocab)}
    scale = keep.to(grad_output.dtype)
    if module.mode == "mean":
        count = torch.zeros(n, dtype=grad_output.dtype, device=indices.device)
        count.index_add_(0, bag.clamp(0, n - 1), scale)
        scale = scale / count.clamp(min=1)[bag.clamp(0, n - 1)]
    elif psw is not None:
        scale = scale * psw.detach().to(grad_output.dtype)
    bag = bag.clamp(0, n - 1)
    rows = grad_output[bag] * scale.unsqueeze(1)
    return {"weight": EmbeddingSampleGrads.from_positions(bag, indices, rows, n, vocab)}

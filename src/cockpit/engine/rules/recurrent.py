"""Recurrent layers (nn.RNN, nn.GRU, nn.LSTM) as an unrolled recurrence in plain torch.

The fused kernels of the recurrent layers cannot be batched by ``torch.func.vmap``. The
general fallback (:mod:`cockpit.engine.rules.fallback`) therefore differentiates this
functional form instead: the same recurrence, written out step by step with the module's
own parameters, gives each sample's vector-Jacobian product

    g_n = (∂(y_n, h_n, c_n)/∂θ)ᵀ (δ^y_n, δ^h_n, δ^c_n)

exactly (up to rounding). Per layer l and direction, with gates in PyTorch's order:

* RNN:  h_t = act(W_ih x_t + b_ih + W_hh h_{t−1} + b_hh), act = tanh or relu;
* GRU:  r, z = σ(W_i{r,z} x_t + b_i{r,z} + W_h{r,z} h_{t−1} + b_h{r,z}),
        n = tanh(W_in x_t + b_in + r ⊙ (W_hn h_{t−1} + b_hn)),  h_t = (1 − z) ⊙ n + z ⊙ h_{t−1};
* LSTM: i, f, o = σ(·), g = tanh(·) of W_ih x_t + b_ih + W_hh h_{t−1} + b_hh,
        c_t = f ⊙ c_{t−1} + i ⊙ g,  h_t = o ⊙ tanh(c_t)  (times W_hr with ``proj_size``).

The reverse direction runs from the end of each sequence to its start; the input of layer
l > 0 is the concatenated output of layer l − 1. Packed sequences are unpacked: a sample of
length L_n updates its state only at t < L_n (so the reverse direction starts at L_n − 1).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence


def recurrent_message(module: nn.RNNBase, args: tuple, kwargs: dict) -> str | None:
    """Why Cockpit cannot form this call's individual gradients, or None."""
    name = type(module).__name__
    if module.dropout > 0 and module.training and module.num_layers > 1:
        return (f"{name} with dropout={module.dropout} between layers in training mode draws "
                "random masks Cockpit cannot replay: individual gradients are not computed "
                "(set dropout=0 and put an nn.Dropout after the layer, or use eval mode)")
    x = args[0] if args else kwargs.get("input")
    if isinstance(x, Tensor) and x.dim() == 2:
        return (f"{name} received an unbatched input of shape {tuple(x.shape)}; Cockpit needs "
                "a batch dimension")
    return None


def unpack_input(module: nn.RNNBase, args: tuple, kwargs: dict
                 ) -> tuple[Tensor, Tensor | None, object]:
    """(padded input with the batch in the original order, lengths or None, hx)."""
    x = args[0] if args else kwargs["input"]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    if isinstance(x, PackedSequence):
        padded, lengths = pad_packed_sequence(x, batch_first=module.batch_first)
        return padded, lengths, hx
    return x, None, hx


def packed_output_grad(module: nn.RNNBase, packed_input: PackedSequence, grad: Tensor,
                       total_length: int) -> Tensor:
    """The gradient of a packed output's ``data`` as a padded tensor (original order)."""
    packed = PackedSequence(grad, packed_input.batch_sizes, packed_input.sorted_indices,
                            packed_input.unsorted_indices)
    padded, _ = pad_packed_sequence(packed, batch_first=module.batch_first,
                                    total_length=total_length)
    return padded


def _cell(mode: str, x: Tensor, state, w_ih, w_hh, b_ih, b_hh, w_hr,
          separate_state: bool = False):
    """One step of one direction of one layer; x: [B, I], state h or (h, c): [B, H]
    (``separate_state``: an LSTM's h formed from c outside autograd, :func:`cell_forward`)."""
    h = state[0] if mode == "LSTM" else state
    gi = x @ w_ih.T
    gh = h @ w_hh.T
    if b_ih is not None:
        gi = gi + b_ih
        gh = gh + b_hh
    if mode == "GRU":
        i_r, i_z, i_n = gi.chunk(3, -1)
        h_r, h_z, h_n = gh.chunk(3, -1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h
    if mode == "LSTM":
        i, f, g, o = (gi + gh).chunk(4, -1)
        c = torch.sigmoid(f) * state[1] + torch.sigmoid(i) * torch.tanh(g)
        h_new = torch.sigmoid(o) * torch.tanh(c.detach() if separate_state else c)
        if w_hr is not None:
            h_new = h_new @ w_hr.T
        return h_new, c
    pre = gi + gh
    return torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)


def recurrent_forward(module: nn.RNNBase, params: dict[str, Tensor], x: Tensor,
                      lengths: Tensor | None = None, hx=None):
    """``module(x, hx)`` as an unrolled recurrence with ``params`` (attribute names of the
    flat weights; missing ones are read from the module). Returns (output, h_n) or
    (output, (h_n, c_n)) like the module; with ``lengths`` the output is padded."""
    mode = module.mode
    num_dirs = 2 if module.bidirectional else 1
    seq = x.transpose(0, 1) if module.batch_first else x  # [T, B, I]
    steps, batch = seq.shape[0], seq.shape[1]
    hidden = module.proj_size if getattr(module, "proj_size", 0) > 0 else module.hidden_size

    def weight(name: str) -> Tensor | None:
        if name in params:
            return params[name]
        return getattr(module, name, None)

    if hx is None:
        zeros = seq.new_zeros(module.num_layers * num_dirs, batch, hidden)
        h0 = zeros
        c0 = seq.new_zeros(module.num_layers * num_dirs, batch, module.hidden_size)
    elif mode == "LSTM":
        h0, c0 = hx
    else:
        h0, c0 = hx, None
    mask = None
    if lengths is not None:
        mask = torch.arange(steps, device=seq.device).unsqueeze(1) < lengths.reshape(1, -1)
        mask = mask.unsqueeze(-1)  # [T, B, 1]
    layer_input = seq
    finals_h, finals_c = [], []
    for layer in range(module.num_layers):
        outputs = []
        for direction in range(num_dirs):
            suffix = f"_l{layer}" + ("_reverse" if direction else "")
            w = [weight(f"{kind}{suffix}") for kind in
                 ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")]
            k = layer * num_dirs + direction
            state = (h0[k], c0[k]) if mode == "LSTM" else h0[k]
            order = range(steps - 1, -1, -1) if direction else range(steps)
            out_t: list[Tensor] = [None] * steps  # type: ignore[list-item]
            for t in order:
                new = _cell(mode, layer_input[t], state, *w)
                if mask is not None:
                    keep = mask[t]
                    if mode == "LSTM":
                        new = (torch.where(keep, new[0], state[0]),
                               torch.where(keep, new[1], state[1]))
                    else:
                        new = torch.where(keep, new, state)
                state = new
                h_t = state[0] if mode == "LSTM" else state
                out_t[t] = h_t if mask is None else h_t * mask[t]
            outputs.append(torch.stack(out_t))
            finals_h.append(state[0] if mode == "LSTM" else state)
            if mode == "LSTM":
                finals_c.append(state[1])
        layer_input = torch.cat(outputs, -1) if num_dirs == 2 else outputs[0]
    output = layer_input.transpose(0, 1) if module.batch_first else layer_input
    h_n = torch.stack(finals_h)
    if mode == "LSTM":
        return output, (h_n, torch.stack(finals_c))
    return output, h_n


def cell_mode(module: nn.RNNCellBase) -> str:
    """The recurrence of a cell in :func:`_cell`'s terms (``"RNN_TANH"``, ``"RNN_RELU"``,
    ``"GRU"``, ``"LSTM"``)."""
    if isinstance(module, nn.LSTMCell):
        return "LSTM"
    if isinstance(module, nn.GRUCell):
        return "GRU"
    return "RNN_RELU" if getattr(module, "nonlinearity", "tanh") == "relu" else "RNN_TANH"


def cell_message(module: nn.RNNCellBase, args: tuple, kwargs: dict) -> str | None:
    """Why Cockpit cannot form this cell call's individual gradients, or None."""
    x = args[0] if args else kwargs.get("input")
    if isinstance(x, Tensor) and x.dim() != 2:
        return (f"{type(module).__name__} received an unbatched input of shape "
                f"{tuple(x.shape)}; Cockpit needs a batch dimension (input [batch, features])")
    return None


def cell_forward(module: nn.RNNCellBase, params: dict[str, Tensor], x: Tensor, hx=None,
                 separate_state: bool = False):
    """``module(x, hx)`` for one step of a cell (nn.RNNCell, nn.GRUCell, nn.LSTMCell) with
    ``params`` (attribute names; missing ones are read from the module); x: [B, I]. A
    missing ``hx`` is zeros, as in the cell. Returns h, or (h, c) for an LSTM cell.

    ``separate_state``: an LSTM cell's h = o ⊙ tanh(c) is formed from c outside autograd.
    The gradient hook on c receives ∂L/∂c including the path through h; the vector-Jacobian
    product of (h, c) with the hooks' (δ^h, δ^c) then counts that path once, through c:

        g = (∂h/∂θ |_c fixed)ᵀ δ^h + (∂c/∂θ)ᵀ δ^c,

    which is the gradient of the cell's contribution (∂h/∂θ = ∂h/∂θ|_c + ∂h/∂c ∂c/∂θ and
    δ^c = δ^c_outside + (∂h/∂c)ᵀ δ^h)."""

    def weight(name: str) -> Tensor | None:
        if name in params:
            return params[name]
        return getattr(module, name, None)

    w_ih, w_hh, b_ih, b_hh = (weight(k) for k in ("weight_ih", "weight_hh", "bias_ih",
                                                   "bias_hh"))
    assert w_ih is not None and w_hh is not None
    mode = cell_mode(module)
    if hx is None:
        zeros = x.new_zeros(x.shape[0], module.hidden_size)
        hx = (zeros, zeros) if mode == "LSTM" else zeros
    return _cell(mode, x, hx, w_ih, w_hh, b_ih, b_hh, None, separate_state)

"""The larger DeepOBS architectures: VGG16/19, All-CNN-C, Wide ResNets, Inception-v3 and the
character-level LSTM. Layer by layer as in DeepOBS's TensorFlow definitions (``_vgg.py``,
``cifar100_allcnnc.py``, ``_wrn.py``, ``_inception_v3.py``) and its PyTorch char-RNN;
TensorFlow's "same" padding is reproduced where it is asymmetric.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cockpit.benchmark.problems.small_nets import xavier_init

# --- VGG ---------------------------------------------------------------------------------
VGG_BLOCKS = {16: (2, 2, 3, 3, 3), 19: (2, 2, 4, 4, 4)}


class VGG(nn.Module):
    """DeepOBS's VGG16 / VGG19 (Simonyan & Zisserman 2015): inputs resized (bilinear) to
    224×224, 3×3 convolutions with ReLU in five blocks of 64, 128, 256, 512, 512 filters
    (2, 2, 3, 3, 3 layers for VGG16; 2, 2, 4, 4, 4 for VGG19), each block followed by 2×2
    max-pooling; then dense 4096 – dropout 0.5 – dense 4096 – dropout 0.5 – dense
    ``num_classes``. Convolutions Glorot-normal, dense layers Glorot-uniform, biases zero.
    (DeepOBS's TensorFlow model regularizes only the convolution kernels; see
    ``l2_parameters``.)"""

    def __init__(self, depth: int = 16, num_classes: int = 10, resize: int | None = 224):
        super().__init__()
        layers: list[nn.Module] = []
        in_channels = 3
        for filters, count in zip((64, 128, 256, 512, 512), VGG_BLOCKS[depth], strict=True):
            for _ in range(count):
                layers += [nn.Conv2d(in_channels, filters, 3, padding=1), nn.ReLU()]
                in_channels = filters
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(4096, num_classes),
        )
        self.resize = resize
        xavier_init(self)

    def l2_parameters(self) -> list[nn.Parameter]:
        """The convolution kernels (what DeepOBS's VGG regularizes)."""
        return [m.weight for m in self.features if isinstance(m, nn.Conv2d)]

    def forward(self, x: Tensor) -> Tensor:
        if self.resize is not None and x.shape[-2:] != (self.resize, self.resize):
            x = F.interpolate(x, size=(self.resize, self.resize), mode="bilinear",
                              align_corners=False)
        return self.classifier(self.features(x))


# --- All-CNN-C -------------------------------------------------------------------------------
def all_cnn_c(num_classes: int = 100) -> nn.Sequential:
    """All-CNN-C (Springenberg et al. 2015) as DeepOBS: dropout 0.2 on the input; 3×3
    convolutions 96, 96, 96 (stride 2), dropout 0.5, 192, 192, 192 (stride 2), dropout 0.5,
    192 (3×3 valid), 192 (1×1), ``num_classes`` (1×1), all with ReLU ("same" padding unless
    valid), then global average pooling. Glorot-normal kernels, biases 0.1
    (1,387,108 parameters for 100 classes)."""

    def conv(c_in: int, c_out: int, k: int = 3, stride: int = 1, valid: bool = False):
        if valid or k == 1:
            return [nn.Conv2d(c_in, c_out, k, stride), nn.ReLU()]
        if stride == 1:
            return [nn.Conv2d(c_in, c_out, k, padding=k // 2), nn.ReLU()]
        # TF "same" with stride 2 and a 3×3 kernel on even sizes pads 0 before, 1 after
        return [nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(c_in, c_out, k, stride), nn.ReLU()]

    model = nn.Sequential(
        nn.Dropout(0.2),
        *conv(3, 96), *conv(96, 96), *conv(96, 96, stride=2),
        nn.Dropout(0.5),
        *conv(96, 192), *conv(192, 192), *conv(192, 192, stride=2),
        nn.Dropout(0.5),
        *conv(192, 192, valid=True), *conv(192, 192, 1), *conv(192, num_classes, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.xavier_normal_(module.weight)
            nn.init.constant_(module.bias, 0.1)
    return model


# --- Wide ResNet ------------------------------------------------------------------------------
def _tf_same_conv(c_in: int, c_out: int, k: int, stride: int) -> nn.Module:
    """Bias-free convolution with TF "same" padding (asymmetric for stride 2)."""
    if stride == 1:
        return nn.Conv2d(c_in, c_out, k, padding=k // 2, bias=False)
    total = max(k - stride, 0)  # for even input sizes
    pad = (total // 2, total - total // 2, total // 2, total - total // 2)
    return nn.Sequential(nn.ZeroPad2d(pad), nn.Conv2d(c_in, c_out, k, stride, bias=False))


class _WideUnit(nn.Module):
    """Pre-activation residual unit: BN–ReLU–conv3×3(stride)–BN–ReLU–conv3×3, plus the
    shortcut (identity, max-pool, or a 1×1 convolution of the pre-activated input when the
    width changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int, bn_momentum: float):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c_in, eps=1e-5, momentum=bn_momentum)
        self.conv1 = _tf_same_conv(c_in, c_out, 3, stride)
        self.bn2 = nn.BatchNorm2d(c_out, eps=1e-5, momentum=bn_momentum)
        self.conv2 = _tf_same_conv(c_out, c_out, 3, 1)
        if c_in != c_out:
            self.shortcut: nn.Module = _tf_same_conv(c_in, c_out, 1, stride)
        elif stride != 1:
            self.shortcut = nn.MaxPool2d(stride, stride)
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(x))
        out = self.conv2(F.relu(self.bn2(self.conv1(x))))
        return out + self.shortcut(x)


class _PlainUnit(nn.Module):
    """Further residual units: x + conv3×3(ReLU(BN(conv3×3(ReLU(BN(x))))))."""

    def __init__(self, channels: int, bn_momentum: float):
        super().__init__()
        self.body = nn.Sequential(
            nn.BatchNorm2d(channels, eps=1e-5, momentum=bn_momentum), nn.ReLU(),
            _tf_same_conv(channels, channels, 3, 1),
            nn.BatchNorm2d(channels, eps=1e-5, momentum=bn_momentum), nn.ReLU(),
            _tf_same_conv(channels, channels, 3, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


def wide_resnet(depth: int, widening: int, num_classes: int,
                bn_momentum: float = 0.1) -> nn.Sequential:
    """WRN-``depth``-``widening`` (Zagoruyko & Komodakis 2016) as DeepOBS: a 3×3 convolution
    with 16 filters, three groups of (depth − 4)/6 pre-activation units with 16k, 32k, 64k
    filters (strides 1, 2, 2), BN–ReLU, global average pooling, dense ``num_classes``.
    Convolutions bias-free and Glorot-uniform, BN ε = 10⁻⁵ and TF momentum 0.9 (torch
    0.1), dense Glorot-uniform with zero bias."""
    if (depth - 4) % 6:
        raise ValueError(f"WRN depth must be 6n + 4, got {depth}")
    units = (depth - 4) // 6
    widths = [16, 16 * widening, 32 * widening, 64 * widening]
    layers: list[nn.Module] = [_tf_same_conv(3, 16, 3, 1)]
    for group, stride in zip(range(1, 4), (1, 2, 2), strict=True):
        layers.append(_WideUnit(widths[group - 1], widths[group], stride, bn_momentum))
        layers += [_PlainUnit(widths[group], bn_momentum) for _ in range(units - 1)]
    layers += [nn.BatchNorm2d(widths[3], eps=1e-5, momentum=bn_momentum), nn.ReLU(),
               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[3], num_classes)]
    model = nn.Sequential(*layers)
    for module in model.modules():
        if isinstance(module, nn.Conv2d | nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return model


# --- Inception-v3 ------------------------------------------------------------------------------
def _pad_same(k: tuple[int, int]) -> tuple[int, int]:
    return (k[0] // 2, k[1] // 2)


class _ConvBN(nn.Module):
    """Bias-free convolution – BatchNorm (TF momentum 0.9997, ε = 10⁻³) – ReLU."""

    def __init__(self, c_in: int, c_out: int, k, stride: int = 1, same: bool = True):
        super().__init__()
        k = (k, k) if isinstance(k, int) else tuple(k)
        padding = _pad_same(k) if same else (0, 0)
        self.conv = nn.Conv2d(c_in, c_out, k, stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(c_out, eps=1e-3, momentum=1 - 0.9997)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)))


def _avg_pool_same(x: Tensor) -> Tensor:
    """3×3 average pooling, stride 1, TF "same" (padding not counted)."""
    return F.avg_pool2d(x, 3, 1, padding=1, count_include_pad=False)


class _Block5(nn.Module):
    def __init__(self, c_in: int, pool_filters: int):
        super().__init__()
        self.b0 = _ConvBN(c_in, 64, 1)
        self.b1 = _ConvBN(c_in, pool_filters, 1)
        self.b2 = nn.Sequential(_ConvBN(c_in, 48, 1), _ConvBN(48, 64, 5))
        self.b3 = nn.Sequential(_ConvBN(c_in, 64, 1), _ConvBN(64, 96, 3), _ConvBN(96, 96, 3))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.b0(x), self.b1(_avg_pool_same(x)), self.b2(x), self.b3(x)], 1)


class _Block10(nn.Module):
    def __init__(self, c_in: int):
        super().__init__()
        self.b1 = _ConvBN(c_in, 384, 3, 2, same=False)
        self.b2 = nn.Sequential(_ConvBN(c_in, 64, 1), _ConvBN(64, 96, 3),
                                _ConvBN(96, 96, 3, 2, same=False))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([F.max_pool2d(x, 3, 2), self.b1(x), self.b2(x)], 1)


class _Block6(nn.Module):
    def __init__(self, c_in: int, n: int):
        super().__init__()
        self.b0 = _ConvBN(c_in, 192, 1)
        self.b1 = _ConvBN(c_in, 192, 1)
        self.b2 = nn.Sequential(_ConvBN(c_in, n, 1), _ConvBN(n, n, (1, 7)),
                                _ConvBN(n, 192, (7, 1)))
        self.b3 = nn.Sequential(_ConvBN(c_in, n, 1), _ConvBN(n, n, (7, 1)), _ConvBN(n, n, (1, 7)),
                                _ConvBN(n, n, (7, 1)), _ConvBN(n, 192, (1, 7)))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.b0(x), self.b1(_avg_pool_same(x)), self.b2(x), self.b3(x)], 1)


class _BlockD(nn.Module):
    def __init__(self, c_in: int):
        super().__init__()
        self.b1 = nn.Sequential(_ConvBN(c_in, 192, 1), _ConvBN(192, 192, (1, 7)),
                                _ConvBN(192, 192, (7, 1)), _ConvBN(192, 192, 3, 2, same=False))
        self.b2 = nn.Sequential(_ConvBN(c_in, 192, 1), _ConvBN(192, 320, 3, 2, same=False))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([F.max_pool2d(x, 3, 2), self.b1(x), self.b2(x)], 1)


class _Block7(nn.Module):
    def __init__(self, c_in: int):
        super().__init__()
        self.b0 = _ConvBN(c_in, 320, 1)
        self.b1 = _ConvBN(c_in, 384, 1)
        self.b1_13, self.b1_31 = _ConvBN(384, 384, (1, 3)), _ConvBN(384, 384, (3, 1))
        self.b2 = nn.Sequential(_ConvBN(c_in, 448, 1), _ConvBN(448, 384, 3))
        self.b2_13, self.b2_31 = _ConvBN(384, 384, (1, 3)), _ConvBN(384, 384, (3, 1))
        self.b3 = _ConvBN(c_in, 192, 1)

    def forward(self, x: Tensor) -> Tensor:
        b1, b2 = self.b1(x), self.b2(x)
        return torch.cat([self.b0(x), self.b1_13(b1), self.b1_31(b1), self.b2_13(b2),
                          self.b2_31(b2), self.b3(_avg_pool_same(x))], 1)


class InceptionV3(nn.Module):
    """Inception-v3 (Szegedy et al. 2016) as DeepOBS: inputs resized (bilinear) to 299×299;
    stem, three 35×35 blocks, a grid reduction, four 17×17 blocks, the auxiliary head
    (5×5/3 average pool, 1×1 conv 128, 5×5 conv 768, dense), a second reduction, two 8×8
    blocks, 8×8 average pooling, dropout (DeepOBS's rate 0.8) and dense ``num_classes``
    (1,001: class 0 is background). Every convolution is conv–BN–ReLU without bias.

    In training mode ``forward`` returns ``(logits, aux_logits)``, in eval mode the logits.
    """

    def __init__(self, num_classes: int = 1001, resize: int | None = 299):
        super().__init__()
        self.resize = resize
        self.stem = nn.Sequential(
            _ConvBN(3, 32, 3, 2, same=False), _ConvBN(32, 32, 3, same=False), _ConvBN(32, 64, 3),
            nn.MaxPool2d(3, 2),
            _ConvBN(64, 80, 1, same=False), _ConvBN(80, 192, 3, same=False),
            nn.MaxPool2d(3, 2),
        )
        self.blocks_a = nn.Sequential(_Block5(192, 32), _Block5(256, 64), _Block5(288, 64),
                                      _Block10(288))
        self.blocks_b = nn.Sequential(_Block6(768, 128), _Block6(768, 160), _Block6(768, 160),
                                      _Block6(768, 192))
        self.aux = nn.Sequential(nn.AvgPool2d(5, 3), _ConvBN(768, 128, 1),
                                 _ConvBN(128, 768, 5, same=False), nn.Flatten(),
                                 nn.Linear(768, num_classes))
        self.blocks_c = nn.Sequential(_BlockD(768), _Block7(1280), _Block7(2048))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Dropout(0.8), nn.Flatten(),
                                  nn.Linear(2048, num_classes))
        for module in self.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def l2_parameters(self) -> list[nn.Parameter]:
        """The convolution kernels (DeepOBS does not regularize the two dense layers)."""
        return [m.weight for m in self.modules() if isinstance(m, nn.Conv2d)]

    def forward(self, x: Tensor):
        if self.resize is not None and x.shape[-2:] != (self.resize, self.resize):
            x = F.interpolate(x, size=(self.resize, self.resize), mode="bilinear",
                              align_corners=False)
        x = self.blocks_b(self.blocks_a(self.stem(x)))
        logits = self.head(self.blocks_c(x))
        if self.training:
            return logits, self.aux(x)
        return logits


# --- character RNN -----------------------------------------------------------------------------
class CharRNN(nn.Module):
    """DeepOBS's char-RNN on Tolstoi: embedding 83 → 128, a two-layer LSTM with 128 units,
    dense 128 → 83 per position. Output ``[B, T, 83]`` logits.

    Dropout as DeepOBS's TensorFlow cells (each layer keeps its inputs and its outputs with
    probability 0.8): 0.2 on the embedding, 1 − 0.8² = 0.36 between the layers (two masks
    in a row), 0.2 on the LSTM's output.

    Stateful as DeepOBS's TensorFlow model: the final (h, c) of a batch (detached) is the
    initial state of the next batch of the same size; :meth:`reset_state` (called when a
    loader starts an epoch) sets it to zero.

    Initialized as the TensorFlow original (the version the published baselines ran):
    ``tf.get_variable``'s default Glorot-uniform U(±√(6/(fan_in + fan_out))) for the
    embedding [83, 128], each LSTM kernel [256, 512] (TF's one kernel over [x, h] and the four
    gates: PyTorch's ``weight_ih`` and ``weight_hh`` are its two halves, so both use the limit
    √(6/768)), the softmax weights [128, 83] and the softmax bias [83] (fan_in = fan_out = 83);
    LSTM biases zero. TF's ``LSTMCell`` adds ``forget_bias`` = 1 to the forget gate's
    pre-activation: here the forget part of ``bias_ih`` starts at 1 (the same function and,
    a constant shift of a trainable bias, the same gradients). TF has one bias per gate, PyTorch
    two (``bias_ih`` + ``bias_hh``): ``bias_hh`` is frozen at zero (``requires_grad=False``),
    so the trainable parameters are TF's: 284,499.

    The layers are single-layer LSTMs with an ``nn.Dropout`` between them: the same function
    as ``nn.LSTM(num_layers=2, dropout=0.36)``, but the dropout masks are drawn outside the
    recurrent layers, so Cockpit can form their individual gradients."""

    def __init__(self, vocab_size: int = 83, hidden: int = 128, num_layers: int = 2,
                 keep: float = 0.8):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.lstm = nn.ModuleList(nn.LSTM(hidden, hidden, batch_first=True)
                                  for _ in range(num_layers))
        self.dense = nn.Linear(hidden, vocab_size)
        self.input_dropout = nn.Dropout(1 - keep)
        self.between_dropout = nn.Dropout(1 - keep**2)
        self.output_dropout = nn.Dropout(1 - keep)
        self._state: list[tuple[Tensor, Tensor]] | None = None
        self._tensorflow_init()

    @torch.no_grad()
    def _tensorflow_init(self) -> None:
        nn.init.xavier_uniform_(self.embedding.weight)
        nn.init.xavier_uniform_(self.dense.weight)
        limit = (6.0 / (2 * self.dense.out_features)) ** 0.5  # TF's fans of a 1-D variable
        nn.init.uniform_(self.dense.bias, -limit, limit)
        for layer in self.lstm:
            fan_in = layer.input_size + layer.hidden_size  # TF's kernel acts on [x, h]
            limit = (6.0 / (fan_in + 4 * layer.hidden_size)) ** 0.5
            nn.init.uniform_(layer.weight_ih_l0, -limit, limit)
            nn.init.uniform_(layer.weight_hh_l0, -limit, limit)
            layer.bias_ih_l0.zero_()
            layer.bias_ih_l0[layer.hidden_size:2 * layer.hidden_size] = 1.0  # gates i, f, g, o
            layer.bias_hh_l0.zero_()
            layer.bias_hh_l0.requires_grad_(False)

    def reset_state(self) -> None:
        self._state = None

    def forward(self, x: Tensor) -> Tensor:
        state = self._state
        if state is not None and state[0][0].shape[1] != x.shape[0]:
            state = None
        out = self.input_dropout(self.embedding(x))
        new_state = []
        for i, layer in enumerate(self.lstm):
            if i:
                out = self.between_dropout(out)
            out, (h, c) = layer(out, None if state is None else state[i])
            new_state.append((h.detach(), c.detach()))
        self._state = new_state
        return self.dense(self.output_dropout(out))

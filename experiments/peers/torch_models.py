"""PyTorch twins of jaxpar's MLP, CNN and ResNet (jaxpar/models/), for the `peers` study.

    python -m pytest -q tests/experiments/peers/test_peers.py     # twins equal jaxpar's models, weight for weight

Same layers, sizes and parameter counts; weights copied across (`load_jax_params`) give the
same logits, loss and gradients. Layout differences are handled at the copy, not in the
models, so each twin is what a PyTorch user would write: NCHW images, [out, in] Linear
weights, OIHW conv kernels, flatten in (C, H, W) order. One exception keeps them exact: a
stride-2 3x3 conv pads SAME the way XLA does (0 before, 1 after; PyTorch's padding=1 pads 1
on both sides and samples other pixels).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

# jaxpar's BatchNorm momentum (decay of the running mean, flax convention) in one place.
from jaxpar.models.cnn import BN_MOMENTUM

# flax's default kernel init is LeCun normal: variance 1/fan_in, a normal truncated at 2 std
# whose std is corrected by this factor (scipy.stats.truncnorm(-2, 2).std()).
_TRUNC_STD = 0.87962566103423978


def lecun_normal_(weight: torch.Tensor) -> None:
    """flax's `lecun_normal` in place (fan_in = all dims but the first in PyTorch layout)."""
    fan_in = weight[0].numel()
    std = math.sqrt(1.0 / fan_in) / _TRUNC_STD
    nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)


def _flax_init(module: nn.Module) -> None:
    """flax's defaults (LeCun normal kernels, zero biases, unit BN scale): same init family."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            lecun_normal_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class MLP(nn.Module):
    """784 -> `depth` x (Linear(`width`) + ReLU) -> Linear(10); jaxpar.models.MLP."""

    def __init__(self, depth: int = 2, width: int = 512, num_classes: int = 10):
        super().__init__()
        sizes = [28 * 28] + [width] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.out = nn.Linear(sizes[-1], num_classes)
        _flax_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.flatten(1)
        for layer in self.hidden:
            h = F.relu(layer(h))
        return self.out(h)


class CNN(nn.Module):
    """conv3x3(32)-ReLU-pool-conv3x3(64)-ReLU-pool-Linear(128)-ReLU-Linear(10); jaxpar.models.CNN."""

    flatten_chw = (64, 7, 7)  # fc1's input, in the order PyTorch flattens it

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(math.prod(self.flatten_chw), 128)
        self.fc2 = nn.Linear(128, num_classes)
        _flax_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _conv_bn(cin: int, cout: int, kernel: int, stride: int) -> tuple[nn.Module, nn.BatchNorm2d]:
    """A bias-free conv with XLA's SAME padding, and its BatchNorm (momentum in torch's sense)."""
    if kernel == 3 and stride == 2:
        conv = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(cin, cout, 3, 2, bias=False))
    else:
        conv = nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False)
    return conv, nn.BatchNorm2d(cout, eps=1e-5, momentum=1 - BN_MOMENTUM)


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus shortcut (1x1 projection when the shape changes), ReLU."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, cout, 3, stride)
        self.conv2, self.bn2 = _conv_bn(cout, cout, 3, 1)
        self.project = stride != 1 or cin != cout
        if self.project:
            self.proj_conv, self.proj_bn = _conv_bn(cin, cout, 1, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (self.proj_bn(self.proj_conv(x)) if self.project else x))


class ResNet(nn.Module):
    """ResNet-(6*depth+2), widths 16/32/64, global average pool; jaxpar.models.ResNet."""

    def __init__(self, depth: int = 1, num_classes: int = 10):
        super().__init__()
        self.stem_conv, self.stem_bn = _conv_bn(1, 16, 3, 1)
        blocks, cin = [], 16
        for stage, cout in enumerate((16, 32, 64)):
            for i in range(depth):
                blocks.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(64, num_classes)
        _flax_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem_bn(self.stem_conv(x)))
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean((2, 3)))


# The twins, by jaxpar's model names (jaxpar.models.MODELS); models without one are refused.
TWINS: dict[str, type[nn.Module]] = {"mlp": MLP, "cnn": CNN, "resnet": ResNet}


def make_twin(name: str, **options) -> nn.Module:
    """The PyTorch twin of jaxpar model `name` (options: as make_model's, e.g. depth, width)."""
    return TWINS[name](**{k: v for k, v in options.items() if v is not None})


def layers(twin: nn.Module, channels: int | None = None) -> list[tuple[str, nn.Module]]:
    """The twin's layers in jaxpar's order and names (`Model.layers()` of jaxpar.models): what a
    pipeline cuts into stages. Each wraps the twin's own modules (no copy of a parameter), and
    run in order they are the twin's forward (tests/experiments/peers/test_peers.py checks both). `channels`:
    the CNN's conv2 as two layers, its first `channels` output channels and the rest, as
    jaxpar's pipelines cut it (`jaxpar.parallel.pipeline.inner_cut`, `CNNCut`)."""
    if isinstance(twin, MLP):
        hidden = [(f"hidden{i}", nn.Sequential(nn.Flatten(1), layer, nn.ReLU()))
                  for i, layer in enumerate(twin.hidden)]
        return hidden + [("out", twin.out)]
    if isinstance(twin, CNN):
        out = twin.conv2.out_channels
        conv2 = ([("conv2", nn.Sequential(twin.conv2, nn.ReLU(), nn.MaxPool2d(2)))] if channels is None else
                 [(f"conv2[:{channels}]", FirstChannels(twin.conv2, channels)),
                  (f"conv2[{channels}:{out}]", LastChannels(twin.conv2, channels))])
        return [("conv1", nn.Sequential(twin.conv1, nn.ReLU(), nn.MaxPool2d(2))), *conv2,
                ("fc1", nn.Sequential(nn.Flatten(1), twin.fc1, nn.ReLU())),
                ("fc2", twin.fc2)]
    raise ValueError(f"{type(twin).__name__}: no layer list (only the MLP and the CNN are cut into stages)")


def _channels_block(conv: nn.Conv2d, part: slice, h: torch.Tensor) -> torch.Tensor:
    """Output channels `part` of `conv` on h, then ReLU and 2x2 max-pool (slices of the
    twin's own parameters: their gradients land in the whole tensors)."""
    y = F.conv2d(h, conv.weight[part], conv.bias[part], conv.stride, conv.padding)
    return F.max_pool2d(F.relu(y), 2)


class FirstChannels(nn.Module):
    """conv2's first k output channels; hands on its input and its channels raveled side by
    side per example (jaxpar's `CNNCut` layout, one tensor: what a pipeline stage sends)."""

    def __init__(self, conv: nn.Conv2d, k: int):
        super().__init__()
        self.conv, self.k = conv, k

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mine = _channels_block(self.conv, slice(0, self.k), h)
        return torch.cat([h.flatten(1), mine.flatten(1)], 1)


class LastChannels(nn.Module):
    """conv2's other output channels on the input `FirstChannels` handed on, joined after its
    channels: conv2's layer's output."""

    def __init__(self, conv: nn.Conv2d, k: int, size: int = 14):
        super().__init__()
        self.conv, self.k, self.size = conv, k, size  # size: conv2's input height and width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, n = self.conv.in_channels, self.conv.in_channels * self.size ** 2
        h = x[:, :n].reshape(-1, c, self.size, self.size)
        mine = x[:, n:].reshape(-1, self.k, self.size // 2, self.size // 2)
        return torch.cat([mine, _channels_block(self.conv, slice(self.k, None), h)], 1)


class Normalize(nn.Module):
    """uint8 images -> float in [0, 1], as jaxpar's step does before the model (a pipeline's
    first stage starts with it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() / 255.0


class Contiguous(nn.Module):
    """Its input in the default (row-major) layout. `images` hands PyTorch jaxpar's NHWC
    batch as an NCHW view, on which the convolutions keep the channels-last layout; gloo
    sends only row-major tensors ("input tensor has to be contiguous")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous()


def stage(twin: nn.Module, starts: tuple[int, ...], index: int, channels: int | None = None) -> nn.Sequential:
    """Stage `index` of the twin cut at `starts` (first layer of each stage, as
    jaxpar.parallel.pipeline.inner_cut.plan gives them; `channels`: conv2 in two layers); the first stage
    normalises the images, every stage but the last hands on a row-major tensor (what gloo
    sends)."""
    found = layers(twin, channels)
    ends = (*starts[1:], len(found))
    modules = [m for _, m in found[starts[index]:ends[index]]]
    return nn.Sequential(*([Normalize()] if index == 0 else []), *modules,
                         *([Contiguous()] if index < len(starts) - 1 else []))


def param_count(model: nn.Module) -> int:
    """Trainable parameters (BN running statistics are buffers, as in jaxpar.models.param_count)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def images(batch: np.ndarray) -> torch.Tensor:
    """jaxpar's uint8 NHWC batch -> a uint8 NCHW tensor (normalised inside the step, as jaxpar does)."""
    return torch.from_numpy(np.ascontiguousarray(batch.transpose(0, 3, 1, 2)))


def flat_params(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """{'blocks.0.conv1.kernel': array, ...} from a nested params dict (nnx.to_pure_dict)."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out.update(flat_params(value, path + ".") if isinstance(value, dict) else {path: np.asarray(value)})
    return out


def _torch_name(jax_path: str, twin_state: dict) -> str:
    """The twin's state name of a jaxpar parameter: kernel/scale -> weight (a padded conv sits
    in a Sequential as its second module)."""
    module, _, leaf = jax_path.rpartition(".")
    name = f"{module}.{'bias' if leaf == 'bias' else 'weight'}"
    return name if name in twin_state else f"{module}.1.{name.rpartition('.')[2]}"


def to_torch_layout(model: nn.Module, jax_path: str, value: np.ndarray) -> np.ndarray:
    """A jaxpar parameter in its twin's layout: Linear [in, out] -> [out, in], conv HWIO ->
    OIHW, and the CNN's fc1 rows from (H, W, C) flatten order to (C, H, W)."""
    if value.ndim == 4:
        return value.transpose(3, 2, 0, 1)
    if value.ndim == 2:
        chw = getattr(model, "flatten_chw", None)
        if chw is not None and value.shape[0] == math.prod(chw):
            c, h, w = chw
            value = value.reshape(h, w, c, -1).transpose(2, 0, 1, 3).reshape(c * h * w, -1)
        return value.T
    return value


def from_torch_layout(model: nn.Module, jax_path: str, value: np.ndarray) -> np.ndarray:
    """Inverse of `to_torch_layout` (gradients back into jaxpar's layout, for comparison)."""
    if value.ndim == 4:
        return value.transpose(2, 3, 1, 0)
    if value.ndim == 2:
        value = value.T
        chw = getattr(model, "flatten_chw", None)
        if chw is not None and value.shape[0] == math.prod(chw):
            c, h, w = chw
            value = value.reshape(c, h, w, -1).transpose(1, 2, 0, 3).reshape(c * h * w, -1)
    return value


def load_jax_params(model: nn.Module, params: dict) -> dict[str, str]:
    """Copy jaxpar parameters (nnx.to_pure_dict of nnx.Param) into the twin, in place.

    Returns:
      {jaxpar path: twin parameter name}, to map gradients back.
    Raises:
      KeyError or ValueError when a parameter has no twin or another shape (not a twin).
    """
    state = dict(model.named_parameters())
    names = {}
    for path, value in flat_params(params).items():
        name = _torch_name(path, state)
        target = state[name]
        new = torch.from_numpy(np.array(to_torch_layout(model, path, value)))  # a writable copy
        if tuple(new.shape) != tuple(target.shape):
            raise ValueError(f"{path} {value.shape} does not fit {name} {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(new)
        names[path] = name
    if set(names.values()) != set(state):
        raise KeyError(f"twin parameters without a jaxpar source: {sorted(set(state) - set(names.values()))}")
    return names

"""WideResNet: a ResNet of bottleneck blocks whose 3x3 convolutions are widened.

Defined here because torchvision does not load beside the CPU torch build. The
architecture is the classic one (He et al. 2016; Zagoruyko & Komodakis 2016):

    stem      7x7 conv (stride 2) -> BatchNorm -> ReLU -> 3x3 max-pool (stride 2)
    layer1..4 `layers[i]` bottleneck blocks; stage i has `planes = base_channels * 2**i`
    head      global average pool -> Linear(planes_4 * 4, num_classes)

A bottleneck block is 1x1 conv (in -> width), 3x3 conv (width -> width, carries the stride of
the block), 1x1 conv (width -> planes * 4), each followed by BatchNorm, ReLU after the first
two and after the residual sum. `width = planes * width_per_group // 64 * groups`, so
`width_per_group = 64` is a plain ResNet and 128 doubles the inner width ("wide_resnet_2").
The first block of a stage projects the shortcut with a strided 1x1 conv + BatchNorm when the
shape changes.

Module names follow the torchvision convention (`conv1`, `bn1`, `layer3.17.conv2`, `fc`) so
that schedules address them the same way as the paper's.

`WideResNet.forward(pixel_values, labels=None)` mirrors HF image classifiers: it returns an
`ImageClassifierOutput` with `.logits` and, when labels are given, `.loss` (cross entropy);
`out["loss"]` and `out.loss` both work, as for the HF models of the zoo.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn import functional as F
from transformers.modeling_outputs import ImageClassifierOutput


@dataclass
class WideResNetConfig:
    """Sizes of a WideResNet; the fields of `configs/models/wideresnet-*.json`."""

    layers: list[int] = field(default_factory=lambda: [6, 8, 46, 6])
    width_per_group: int = 128
    groups: int = 1
    base_channels: int = 64  # stem output and planes of stage 1 (64 in the classic ResNet)
    num_classes: int = 1000
    in_channels: int = 3
    image_size: int = 224  # side of the square input images (the harness makes inputs of it)
    model_type: str = "wideresnet"

    def to_dict(self) -> dict:
        return asdict(self)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (strided, grouped) -> 1x1 convolutions with a residual shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int, width: int, groups: int):
        super().__init__()
        out_channels = planes * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + shortcut)


class WideResNet(nn.Module):
    """ImageNet-style WideResNet classifier built from a `WideResNetConfig`."""

    def __init__(self, config: WideResNetConfig):
        super().__init__()
        self.config = config
        base = config.base_channels
        self.conv1 = nn.Conv2d(config.in_channels, base, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)

        in_channels = base
        for i, num_blocks in enumerate(config.layers):
            planes = base * 2**i
            width = planes * config.width_per_group // 64 * config.groups
            blocks = []
            for j in range(num_blocks):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(Bottleneck(in_channels, planes, stride, width, config.groups))
                in_channels = planes * Bottleneck.expansion
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))

        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, config.num_classes)
        for module in self.modules():
            if not isinstance(module, nn.Linear):  # it keeps the weights it was built with
                self._init_weights(module)

    def _init_weights(self, module: nn.Module) -> None:
        """One module's initial weights, transformers' convention: ``slapo.build`` calls it
        for each module it initialises (upstream's ``build(sch, init_weights=True)``)."""
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    def forward(self, pixel_values: torch.Tensor,
                labels: torch.Tensor | None = None) -> ImageClassifierOutput:
        x = self.maxpool(self.relu(self.bn1(self.conv1(pixel_values))))
        for i in range(len(self.config.layers)):
            x = getattr(self, f"layer{i + 1}")(x)
        logits = self.fc(torch.flatten(self.avgpool(x), 1))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)

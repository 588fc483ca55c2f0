"""pipexplore.flatten: a chain of children as an nn.Sequential (same outputs and gradients), and
clear errors that point to tracing for models that are not chains."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipexplore import GPipe, flatten
from pipexplore.models.flatten import FlattenError


class BasicBlock(nn.Module):
    """torchvision's ResNet block: two 3×3 convolutions, a residual inside the block."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's layout: stem, stages of blocks, pool, ``torch.flatten(x, 1)``, fc."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def test_a_resnet_becomes_a_sequential_of_its_children():
    model = ResNet()
    flat = flatten(model)
    assert isinstance(flat, nn.Sequential)
    assert list(dict(flat.named_children())) == ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "avgpool",
                                                 "flatten", "fc"]
    assert flat.layer1 is model.layer1 and flat.fc is model.fc  # the model's own children, not copies


def test_flattened_outputs_and_gradients_equal_the_model():
    torch.manual_seed(0)
    model, x = ResNet(), torch.randn(4, 3, 16, 16)
    flat = flatten(copy.deepcopy(model))
    expected = model(x)
    got = flat(x)
    torch.testing.assert_close(got, expected)
    expected.square().mean().backward()
    got.square().mean().backward()
    flat_params = dict(flat.named_parameters())  # the children keep their names: the same FQNs
    assert flat_params.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        torch.testing.assert_close(flat_params[name].grad, param.grad)


def test_flattened_model_runs_in_gpipe_like_the_model():
    torch.manual_seed(0)
    model, x = ResNet(), torch.randn(8, 3, 16, 16)
    model.eval()  # batch norm with running statistics: micro-batches give the same outputs as the batch
    pipe = GPipe(flatten(copy.deepcopy(model)), balance=[5, 4], devices=["cpu", "cpu"], chunks=4)
    torch.testing.assert_close(pipe(x), model(x))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) + h


class Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(self.a(x))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.a(x) * y


@pytest.mark.parametrize("model,message", [
    (Residual(), "Residual is not a chain of its children: child 'a' is used again by"),
    (Branch(), "could not follow Branch.forward as a chain of its children"),
    (Twice(), "Twice.forward calls child 'a' more than once"),
    (TwoInputs(), "TwoInputs.forward uses 2 inputs (x, y)"),
])
def test_models_that_are_not_chains_get_a_pointer_to_tracing(model, message):
    with pytest.raises(FlattenError) as info:
        flatten(model)
    assert str(info.value).startswith(message)
    assert "pipexplore.explore(model, sample) splits models that are not chains by tracing them" in str(info.value)


def test_a_sequential_is_returned_as_it_is_and_other_values_are_refused():
    sequential = nn.Sequential(nn.Linear(2, 2))
    assert flatten(sequential) is sequential
    with pytest.raises(TypeError, match="flatten takes an nn.Module, got function"):
        flatten(lambda x: x)

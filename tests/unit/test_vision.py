"""Vision models and the image task: shapes, declared layers, seeding, splits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError, ShapeMismatchError
from fedlr.models import VISION_MODELS, build_vision_model
from fedlr.tasks.image import ImageData, ImageTask, evaluate_images, train_sgd

SHAPES = {
    "cnn": (1, 28, 28),
    "mlp": (1, 28, 28),
    "alexnet": (3, 32, 32),
    "resnet": (3, 32, 32),
}


@pytest.mark.parametrize("name", VISION_MODELS)
@pytest.mark.parametrize("classes", [2, 10])
def test_forward_shape_and_head(name: str, classes: int) -> None:
    model = build_vision_model(name, SHAPES[name], classes, seed=0)
    x = torch.randn(5, *SHAPES[name])
    model.eval()
    logits = model(x)
    assert logits.shape == (5, classes)
    head = model.head_layer()
    assert isinstance(head, nn.Linear) and head.out_features == classes
    feats = model.features(x)
    assert feats.shape == (5, head.in_features)
    torch.testing.assert_close(head(feats), logits)


@pytest.mark.parametrize("name", VISION_MODELS)
def test_declared_layers_exist_and_are_conv_or_linear(name: str) -> None:
    model = build_vision_model(name, SHAPES[name], 10, seed=0)
    modules = dict(model.named_modules())
    layers = model.projected_layers()
    assert layers, "every model projects some layer"
    assert len(set(layers)) == len(layers)
    for layer in layers:
        assert isinstance(modules[layer], nn.Conv2d | nn.Linear)
        assert model.layer(layer) is modules[layer]
    # forward order: the declared order is the order of registration
    registered = [n for n, m in model.named_modules() if n in layers]
    assert registered == list(layers)
    assert model.head in modules and isinstance(modules[model.head], nn.Linear)
    with pytest.raises(KeyError, match="no layer"):
        model.layer("nope")


@pytest.mark.parametrize("name", VISION_MODELS)
def test_seeded_initialisation(name: str) -> None:
    a = build_vision_model(name, SHAPES[name], 10, seed=3).state_dict()
    b = build_vision_model(name, SHAPES[name], 10, seed=3).state_dict()
    c = build_vision_model(name, SHAPES[name], 10, seed=4).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_small_images_and_unknown_names() -> None:
    build_vision_model("cnn", (1, 8, 8), 10, seed=0)  # digits size works
    with pytest.raises(ConfigError, match="at least 16x16"):
        build_vision_model("alexnet", (1, 8, 8), 10, seed=0)
    with pytest.raises(ConfigError, match="at least 4x4"):
        build_vision_model("resnet", (1, 3, 8), 10, seed=0)
    with pytest.raises(ConfigError, match="cnn, mlp, alexnet, resnet"):
        build_vision_model("resnet18", (1, 8, 8), 10, seed=0)


def test_resnet20_structure_and_no_running_statistics() -> None:
    model = build_vision_model("resnet", (3, 32, 32), 10, seed=0)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    # stem + 9 blocks x 2 convs + 2 projection shortcuts; with the head: 20 weight
    # layers on the main path (the shortcuts are not counted in "ResNet-20")
    assert len(convs) == 1 + 18 + 2
    assert len(model.projected_layers()) == 21
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 1
    assert not list(model.buffers()), "group norm keeps no running statistics"
    assert 0.25e6 < sum(p.numel() for p in model.parameters()) < 0.3e6
    # a 16x16 input also works (two stride-2 stages: 16 -> 8 -> 4)
    out = build_vision_model("resnet", (1, 16, 16), 3, seed=0)(
        torch.randn(2, 1, 16, 16)
    )
    assert out.shape == (2, 3)


def _toy_data(n: int = 64, seed: int = 0) -> ImageData:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 1, 8, 8, generator=g) + y.view(-1, 1, 1, 1).float()
    return ImageData(x, y)


def test_image_data_checks_shapes_and_selects() -> None:
    data = _toy_data(10)
    sub = data.select([3, 1])
    assert len(sub) == 2 and torch.equal(sub.y, data.y[[3, 1]])
    assert data.in_shape == (1, 8, 8)
    with pytest.raises(ShapeMismatchError, match="N, C, H, W"):
        ImageData(torch.zeros(3, 8, 8), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ShapeMismatchError, match=r"\(3,\)"):
        ImageData(torch.zeros(3, 1, 8, 8), torch.zeros(4, dtype=torch.long))


def test_train_sgd_is_seeded_and_learns() -> None:
    data = _toy_data()
    losses = []
    states = []
    for _ in range(2):
        model = build_vision_model("mlp", (1, 8, 8), 3, seed=1)
        acc0, loss0 = evaluate_images(model, data, batch_size=16)
        losses.append(
            train_sgd(
                model, data, steps=30, lr=0.05, batch_size=16, seed=5, momentum=0.9
            )
        )
        states.append(model.state_dict())
        acc1, loss1 = evaluate_images(model, data, batch_size=16)
        assert loss1 < loss0 and acc1 > acc0
    assert losses[0] == losses[1]
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key])


def test_image_task_splits_digits(tmp_path: object) -> None:
    config = RunConfig(dataset="digits", model="cnn", num_partitions=3, seed=1)
    task = ImageTask(config)
    assert task.in_shape == (1, 8, 8) and task.num_classes == 10
    held = task.heldout()
    parts = [task.partition(i, 3) for i in range(3)]
    assert held.x.dtype == torch.float32 and held.y.dtype == torch.int64
    assert len(held) + sum(len(p) for p in parts) == 1797
    # normalised: roughly zero mean, unit variance over the whole set
    assert abs(float(held.x.mean())) < 0.1 and abs(float(held.x.std()) - 1) < 0.1
    # the same rows as the split, so another task instance agrees exactly
    again = ImageTask(config).partition(1, 3)
    assert torch.equal(again.x, parts[1].x) and torch.equal(again.y, parts[1].y)
    split = task.split()
    labels = np.bincount(parts[0].y.numpy(), minlength=10)
    assert (labels == split.label_counts().iloc[0].to_numpy()).all()
    model = task.build_model()
    assert model(held.x[:4]).shape == (4, 10)
    capped = ImageTask(config.replace(max_eval_examples=50)).heldout()
    assert len(capped) == 50 and torch.equal(capped.x, held.x[:50])


def test_image_task_mnist_offline() -> None:
    task = ImageTask(RunConfig(dataset="mnist", model="mlp", num_partitions=4))
    assert task.in_shape == (1, 28, 28)
    held = task.heldout()
    assert held.x.shape == (14000, 1, 28, 28)
    assert abs(float(held.x.mean())) < 0.05 and abs(float(held.x.std()) - 1) < 0.05


def test_image_task_rejects_text_data_and_text_models() -> None:
    with pytest.raises(ConfigError, match="not an image data set"):
        ImageTask(RunConfig(dataset="polarity", model="cnn"))
    with pytest.raises(ConfigError, match="not a vision model"):
        ImageTask(RunConfig(dataset="digits", model="minilm"))

"""``eval-batch-size = 0``: the largest evaluation batch that fits."""

from __future__ import annotations

import pytest
import torch

from fedlr.client.train import AUTO_EVAL_BATCH, in_batches
from fedlr.tasks.image import ImageData, evaluate_images


def _oom_above(limit: int, seen: list[tuple[int, int]]):
    def step(start: int, stop: int) -> None:
        if stop - start > limit:
            raise torch.OutOfMemoryError("simulated")
        seen.append((start, stop))

    return step


def test_auto_halves_on_out_of_memory_and_covers_every_example_once():
    seen: list[tuple[int, int]] = []
    size = in_batches(3000, 0, _oom_above(100, seen))
    assert size == AUTO_EVAL_BATCH // 16 == 64
    covered = [i for start, stop in seen for i in range(start, stop)]
    assert covered == list(range(3000))


def test_a_fixed_batch_never_changes_and_out_of_memory_propagates():
    seen: list[tuple[int, int]] = []
    assert in_batches(50, 20, _oom_above(100, seen)) == 20
    assert seen == [(0, 20), (20, 40), (40, 50)]
    with pytest.raises(torch.OutOfMemoryError):
        in_batches(500, 200, _oom_above(100, []))


def test_auto_batch_gives_the_fixed_batch_result():
    g = torch.Generator().manual_seed(0)
    data = ImageData(
        x=torch.randn(300, 1, 8, 8, generator=g),
        y=torch.randint(0, 3, (300,), generator=g),
    )
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
    fixed = evaluate_images(model, data, batch_size=32)
    auto = evaluate_images(model, data, batch_size=0)
    assert auto[0] == fixed[0]
    assert auto[1] == pytest.approx(fixed[1], rel=1e-6)

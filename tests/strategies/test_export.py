"""The adapter a run exports reproduces the server's final evaluation exactly.

An in-process run (tiny BERT on polarity) writes ``<run dir>/adapter/``; the
test builds a fresh seeded base model, loads the folded base weights when the
method folds (FedEx-LoRA), loads the adapter with peft's own
``PeftModel.from_pretrained``, evaluates it on the same held-out split and
compares accuracy and loss with ``summary.json``'s final ones with ``==``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from fedlr.config.run import RunConfig
from fedlr.launch.local import run_in_process
from fedlr.runs.export import (
    BASE_WEIGHTS,
    BASE_WEIGHTS_MARKER,
    EXPORT_DIR,
    EXPORT_INFO,
    MissingBaseWeightsError,
    load_adapter,
)
from fedlr.tasks.text import text_task
from tests.conftest import tiny_run_config

pytestmark = pytest.mark.usefixtures("assets")

VERA = {"vera-rank": 16, "vera-lr": 0.05}


def _run(tmp_path: Path, method: str, **extra: Any) -> tuple[Path, dict[str, Any]]:
    config = tiny_run_config(tmp_path, method=method, **extra)
    run_dir = run_in_process(config)
    summary = json.loads((run_dir / "summary.json").read_text())
    return run_dir, summary


def _reload_and_evaluate(run_dir: Path) -> tuple[dict[str, float], list[str]]:
    """Fresh base (+ folded weights) + PeftModel.from_pretrained, evaluated."""
    settings = json.loads((run_dir / "config.json").read_text())
    config = RunConfig.from_mapping(settings)
    task = text_task(config)
    base = task.build_base()
    adapter = run_dir / EXPORT_DIR
    unexpected: list[str] = []
    if (adapter / BASE_WEIGHTS).is_file():
        loaded = base.load_state_dict(load_file(adapter / BASE_WEIGHTS), strict=False)
        unexpected = list(loaded.unexpected_keys)
    model = PeftModel.from_pretrained(base, str(adapter))
    return task.evaluate(model, task.heldout(), torch.device("cpu")), unexpected


@pytest.mark.parametrize(
    ("method", "extra", "content"),
    [
        ("fedavg-lora", {}, "adapter"),
        ("fedex-lora", {}, "adapter+folded-base"),
        ("fedavg-vera", VERA, "adapter"),
    ],
)
def test_exported_adapter_gives_the_final_evaluation(
    method: str, extra: dict[str, Any], content: str, tmp_path: Path
) -> None:
    run_dir, summary = _run(tmp_path, method, **extra)
    adapter = run_dir / EXPORT_DIR
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    info = json.loads((adapter / EXPORT_INFO).read_text())
    assert info["content"] == summary["adapter-content"] == content
    assert info["rounds"] == 2 and info["method"] == method

    settings = json.loads((run_dir / "config.json").read_text())
    assert summary["settings"] == settings and settings["method"] == method
    assert summary["code-version"].startswith(("git ", "fedlr "))
    if content == "adapter+folded-base":
        _check_folded(run_dir, RunConfig.from_mapping(settings))

    result, unexpected = _reload_and_evaluate(run_dir)

    assert unexpected == []
    assert result["accuracy"] == summary["final-accuracy"]
    assert result["loss"] == summary["final-loss"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (BASE_WEIGHTS_MARKER in config) == (content == "adapter+folded-base")
    loaded = _evaluate_with_fedlr_loader(run_dir)  # fedlr's loader: the same numbers
    assert loaded["accuracy"] == summary["final-accuracy"]
    assert loaded["loss"] == summary["final-loss"]
    if content == "adapter+folded-base":  # the folded weights are needed
        _check_missing_base_weights(run_dir, summary)


def _evaluate_with_fedlr_loader(run_dir: Path) -> dict[str, float]:
    import warnings

    config = RunConfig.from_mapping(json.loads((run_dir / "config.json").read_text()))
    task = text_task(config)
    with warnings.catch_warnings():
        # fedlr's loader checked the base weights itself: no marker warning
        warnings.filterwarnings("error", message=f".*{BASE_WEIGHTS_MARKER}")
        model = load_adapter(task.build_base(), run_dir / EXPORT_DIR)
    return task.evaluate(model, task.heldout(), torch.device("cpu"))


def _check_missing_base_weights(run_dir: Path, summary: dict[str, Any]) -> None:
    """Without base_weights.safetensors: fedlr's loader refuses naming the
    file; plain peft loads another model, warning only about the marker key;
    peft's README.md says what is needed first."""
    adapter = run_dir / EXPORT_DIR
    card = (adapter / "README.md").read_text()
    assert f"# Needs {BASE_WEIGHTS}" in card
    assert card.index(f"# Needs {BASE_WEIGHTS}") < card.index("## Model Details")
    (adapter / BASE_WEIGHTS).unlink()
    config = RunConfig.from_mapping(json.loads((run_dir / "config.json").read_text()))
    with pytest.raises(MissingBaseWeightsError, match=BASE_WEIGHTS):
        load_adapter(text_task(config).build_base(), adapter)
    with pytest.warns(UserWarning, match=BASE_WEIGHTS_MARKER):
        without, _ = _reload_and_evaluate(run_dir)
    assert without["loss"] != summary["final-loss"]


def _check_folded(run_dir: Path, config: RunConfig) -> None:
    """The file holds exactly the adapted layers' base weights, each different
    from the freshly built base (the residual was folded in)."""
    folded = load_file(run_dir / EXPORT_DIR / BASE_WEIGHTS)
    fresh = text_task(config).build_base().state_dict()
    adapted = {k for k in fresh if k.endswith(("query.weight", "value.weight"))}
    assert set(folded) == adapted and len(adapted) == 4  # 2 layers x q, v
    for key, weight in folded.items():
        assert weight.shape == fresh[key].shape
        assert not torch.equal(weight, fresh[key]), key


def test_personalised_run_exports_its_shared_part(tmp_path: Path) -> None:
    """FedSA-LoRA keeps B on the clients: the export says it is the shared A."""
    run_dir, summary = _run(tmp_path, "fedsa-lora", **{"num-server-rounds": 1})
    info = json.loads((run_dir / EXPORT_DIR / EXPORT_INFO).read_text())
    assert summary["adapter-content"] == info["content"] == "shared-part"
    assert "lora_A" in info["description"] and "personalised" in info["description"]
    assert "shared part" in (run_dir / EXPORT_DIR / "README.txt").read_text()


LM = {
    "method": "fedavg-lora",
    "model": "tiny-gpt2",
    "dataset": "arith-instruct",
    "num-partitions": 2,
    "partitioner": "iid",
    "num-server-rounds": 2,
    "local-steps": 2,
    "batch-size": 4,
    "max-length": 96,
    "max-eval-examples": 8,
    "max-new-tokens": 4,
    "lora-rank": 4,
    "lora-alpha": 8.0,
    "target-modules": "all-linear",
    "lr": 0.05,
    "seed": 3,
    "device": "cpu",
}


def test_causal_lm_run_exports_tracks_and_plots_its_own_metrics(
    tmp_path: Path,
) -> None:
    """A causal-LM run: ``exact-match`` and ``perplexity`` in results.csv, in
    the TensorBoard events and in ``lm.png``; its exported adapter on a fresh
    tiny GPT-2 gives the final loss, perplexity and exact match exactly."""
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    run_dir = run_in_process(
        {**LM, "tracker": "tensorboard", "output-dir": str(tmp_path)}
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    frame = pd.read_csv(run_dir / "results.csv")
    assert {"exact-match", "perplexity"} <= set(frame.columns)
    assert (run_dir / "lm.png").stat().st_size > 5000

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for column in ("exact-match", "perplexity", "loss"):
        logged = [(e.step, e.value) for e in events.Scalars(column)]
        assert logged == [
            (r, pytest.approx(v, rel=1e-6))
            for r, v in zip(frame["round"], frame[column], strict=True)
        ]

    result, unexpected = _reload_and_evaluate(run_dir)
    assert unexpected == []
    assert result["loss"] == summary["final-loss"]
    assert result["perplexity"] == summary["final-perplexity"]
    assert result["exact-match"] == summary["final-exact-match"]
    assert summary["final-perplexity"] < summary["initial-perplexity"]


def test_arrays_that_do_not_fit_are_reported_not_fatal(tmp_path: Path) -> None:
    """A final state whose shapes the rebuilt model refuses: the summary says
    the export failed and why; nothing is half-written."""
    from fedlr.runs.export import export_adapter
    from fedlr.strategies.registry import resolve

    method = resolve(tiny_run_config(tmp_path, method="fedavg-lora"))
    lm = text_task(method.run).build_lora_model()
    bad = {lm.layout.modules[0].b_key: torch.zeros(3, 3)}
    fields = export_adapter(method, bad, tmp_path, rounds=1)
    assert fields["adapter-export"].startswith("failed: ")
    assert "shape" in fields["adapter-export"].lower()
    assert not (tmp_path / EXPORT_DIR).exists()

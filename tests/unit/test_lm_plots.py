"""``lm.png``: a causal-LM run's exact match and perplexity, from its CSV."""

from __future__ import annotations

from pathlib import Path

from fedlr.runs.plots import figures, load_run, plot_runs
from fedlr.runs.results import ResultsWriter

EXACT = [0.0, 0.125, 0.25]
PERPLEXITY = [60.0, 5.5, 4.25]


def _lm_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "lm"
    writer = ResultsWriter(
        run_dir, method="fedex-lora", extra_columns=("perplexity", "exact-match")
    )
    for t, (em, ppl) in enumerate(zip(EXACT, PERPLEXITY, strict=True), start=1):
        writer.append(
            {"round": t, "accuracy": em, "loss": 1.0, "exact-match": em,
             "perplexity": ppl}
        )  # fmt: skip
    return run_dir


def test_lm_figure_plots_exact_match_and_perplexity(tmp_path: Path) -> None:
    run_dir = _lm_run(tmp_path)
    fig = figures([load_run(run_dir)])["lm.png"]
    ax_em, ax_ppl = fig.axes
    assert list(ax_em.get_lines()[0].get_ydata()) == EXACT
    assert list(ax_ppl.get_lines()[0].get_ydata()) == PERPLEXITY
    assert list(ax_ppl.get_lines()[0].get_xdata()) == [1, 2, 3]
    assert ax_ppl.get_yscale() == "log"
    assert "exact match" in ax_em.get_title()
    assert "perplexity" in ax_ppl.get_title()


def test_lm_png_only_for_runs_with_perplexity(tmp_path: Path) -> None:
    lm = {p.name for p in plot_runs([_lm_run(tmp_path)], tmp_path / "a")}
    assert "lm.png" in lm
    plain = tmp_path / "plain"
    writer = ResultsWriter(plain, method="fedavg-lora")
    writer.append({"round": 1, "accuracy": 0.5, "loss": 0.7})
    assert "lm.png" not in {p.name for p in plot_runs([plain], tmp_path / "b")}

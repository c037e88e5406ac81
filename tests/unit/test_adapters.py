"""LoRA adapters through peft: declared roles, state round trips."""

from __future__ import annotations

import pytest
import torch

from fedlr.adapters import (
    LoraSettings,
    Role,
    adapter_state,
    apply_lora,
    load_adapter_state,
    lora_layout,
    parameters_by_key,
)
from fedlr.errors import ShapeMismatchError
from fedlr.models import build_text_classifier


@pytest.fixture()
def tiny(assets):
    model = build_text_classifier("tiny-bert", 2, seed=0)
    return apply_lora(model, LoraSettings(rank=4, alpha=8.0))


def test_layout_declares_every_adapted_layer(tiny):
    layout = lora_layout(tiny)
    # 2 encoder layers x (query, value)
    assert len(layout.modules) == 4
    names = [m.name.rsplit(".", 1)[-1] for m in layout.modules]
    assert names == ["query", "value", "query", "value"]
    for m in layout.modules:
        assert (m.d_out, m.d_in, m.rank) == (32, 32, 4)
        assert m.scaling == pytest.approx(2.0)
    assert sorted(layout.head_shapes.values()) == [(2,), (2, 32)]
    # Keys are peft's own state-dict keys (A, B, head) and parameter names (W0).
    from peft import get_peft_model_state_dict

    peft_keys = set(get_peft_model_state_dict(tiny))
    assert set(layout.keys(Role.LORA_A, Role.LORA_B, Role.HEAD)) == peft_keys
    names = {n for n, _ in tiny.named_parameters()}
    assert set(layout.keys(Role.BASE)) <= names


def test_state_round_trip_by_role(tiny):
    layout = lora_layout(tiny)
    state = adapter_state(tiny, layout, Role)
    changed = {k: v + 1.0 for k, v in state.items()}
    load_adapter_state(tiny, layout, changed)
    again = adapter_state(tiny, layout, Role)
    for key in state:
        torch.testing.assert_close(again[key], changed[key])
    # The live parameters changed, not copies.
    params = parameters_by_key(tiny, layout)
    key = layout.modules[0].a_key
    torch.testing.assert_close(params[key].detach(), changed[key])


def test_load_rejects_unknown_keys_and_bad_shapes(tiny):
    layout = lora_layout(tiny)
    with pytest.raises(KeyError, match="not in the adapter layout"):
        load_adapter_state(tiny, layout, {"nope": torch.zeros(1)})
    key = layout.modules[0].b_key
    with pytest.raises(ShapeMismatchError, match=r"has shape \(3, 3\)"):
        load_adapter_state(tiny, layout, {key: torch.zeros(3, 3)})


def test_rank_larger_than_layer_is_rejected(assets):
    model = build_text_classifier("tiny-bert", 2, seed=0)
    with pytest.raises(ValueError, match="rank 64 exceeds"):
        apply_lora(model, LoraSettings(rank=64, alpha=8.0))


def test_settings_validate():
    with pytest.raises(ValueError, match="rank must be a positive"):
        LoraSettings(rank=0)
    with pytest.raises(ValueError, match="dropout"):
        LoraSettings(dropout=1.5)


def test_same_seed_same_model(assets):
    a = build_text_classifier("tiny-bert", 3, seed=5)
    b = build_text_classifier("tiny-bert", 3, seed=5)
    c = build_text_classifier("tiny-bert", 3, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_one_layout_base_with_one_meaning_of_check_shapes(tiny):
    from fedlr.adapters import AdaptedModel, RoleLayout, VeraLayout, VeraModule
    from fedlr.adapters.lora import LoraModel
    from fedlr.adapters.vera import VeraModel
    from fedlr.errors import UnknownKeyError

    lora = lora_layout(tiny)
    vera = VeraLayout(
        modules=(VeraModule("l0", "l0.b", "l0.d", "l0.w", d_out=3, d_in=5, rank=2),),
        rank=2,
        projection_seed=0,
        head_shapes={"head": (2, 3)},
    )
    for layout, good in ((lora, lora.modules[0].a_key), (vera, "l0.b")):
        assert isinstance(layout, RoleLayout)
        layout.check_shapes({good: layout.shapes(*Role)[good]})
        with pytest.raises(
            UnknownKeyError, match=r"not in the adapter layout: \['x'\]"
        ):
            layout.check_shapes({"x": (1,)})
        with pytest.raises(ShapeMismatchError, match="layout declares"):
            layout.check_shapes({good: (7, 7)})
    assert issubclass(LoraModel, AdaptedModel) and issubclass(VeraModel, AdaptedModel)


def test_lora_model_state_and_load_follow_roles(tiny):
    from fedlr.adapters.lora import LoraModel

    layout = lora_layout(tiny)
    lm = LoraModel(model=tiny, layout=layout, pristine_base={})
    state = lm.state((Role.LORA_A, Role.HEAD))
    assert set(state) == set(layout.keys(Role.LORA_A, Role.HEAD))
    changed = {k: v + 1.0 for k, v in state.items()}
    lm.load(changed)
    for key, value in lm.state((Role.LORA_A, Role.HEAD)).items():
        torch.testing.assert_close(value, changed[key])
    lm.train_only((Role.LORA_B,))
    trainable = {
        k for k, p in parameters_by_key(tiny, layout).items() if p.requires_grad
    }
    assert trainable == set(layout.keys(Role.LORA_B))

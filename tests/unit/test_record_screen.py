"""Every extra record a reply carries is cast, screened and (where it is an
update) clipped like the arrays; and the weight cap relative to the median.

The screen's bound is recomputed here from its definition (the lower median
of the round's record norms times ``screen-ratio``, floored by the method's
``record_floor``), the norms from the arrays in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedlr.errors import ConfigError, ReplyValidationError
from fedlr.robust.builtin_rules.norm_clip import clip_record
from fedlr.robust.rules import RobustConfig, robust_aggregate
from fedlr.robust.screen import record_norm, screen_record_sizes
from fedlr.robust.spaces import ParameterSpace
from fedlr.round.replies import conform_dtypes
from fedlr.wire.updates import ClientUpdate

REC = "delta"


def _update(node: int, scale: float, n: int = 10, dtype=torch.float32) -> ClientUpdate:
    record = {"a": torch.full((2, 3), scale, dtype=dtype), "b": torch.full((4,), scale)}
    return ClientUpdate.of_arrays(
        {"w": torch.full((3,), float(node))}, n, node_id=node, extras={REC: record}
    )


def test_record_norm_is_the_frobenius_norm_of_all_its_arrays():
    u = _update(1, 2.0)
    assert record_norm(u.extras[REC]) == pytest.approx(math.sqrt(4.0 * 10), rel=1e-15)


def test_the_record_screen_drops_what_is_above_ratio_times_the_lower_median():
    scales = [1.0, 2.0, 3.0, 4.0, 1e3]
    updates = [_update(i, s) for i, s in enumerate(scales)]
    norms = [record_norm(u.extras[REC]) for u in updates]
    out = screen_record_sizes(updates, REC, ratio=20.0, floor=0.0)
    # lower median of five: the third smallest
    assert out.bound == pytest.approx(20.0 * sorted(norms)[2], rel=1e-15)
    assert [u.node_id for u in out.updates] == [0, 1, 2, 3]
    ((node, reason),) = out.reasons
    assert node == 4 and f"record '{REC}'" in reason and "screen-ratio 20" in reason
    # 3e38 (finite in float32) and a non-finite one are dropped too
    updates = [_update(i, s) for i, s in enumerate([1.0, 1.0, 3e38])]
    assert [
        u.node_id for u in screen_record_sizes(updates, REC, 20.0, 0.0).updates
    ] == [0, 1]
    updates = [_update(0, 1.0), _update(1, 1.0), _update(2, float("nan"))]
    out = screen_record_sizes(updates, REC, 20.0, 0.0)
    assert [u.node_id for u in out.updates] == [0, 1]
    assert "not finite" in out.reasons[0][1]


def test_the_floor_keeps_records_no_larger_than_the_methods_state():
    # Two tiny records and one ordinary one: the median alone would drop it;
    # the method's floor (e.g. the norm of its control variate) keeps it.
    updates = [_update(0, 1e-9), _update(1, 1e-9), _update(2, 1.0)]
    ordinary = record_norm(updates[2].extras[REC])
    assert len(screen_record_sizes(updates, REC, 20.0, 0.0).updates) == 2
    assert len(screen_record_sizes(updates, REC, 20.0, ordinary).updates) == 3


def test_one_reply_and_an_off_screen_keep_every_finite_record():
    assert len(screen_record_sizes([_update(0, 1e30)], REC, 20.0, 0.0).updates) == 1
    updates = [_update(0, 1.0), _update(1, 1.0), _update(2, 1e30)]
    assert len(screen_record_sizes(updates, REC, 0.0, 0.0).updates) == 3


def test_records_are_cast_like_the_arrays_and_checked_finite_after_the_cast():
    dtypes = {"a": torch.float32, "w": torch.float32}
    fine = _update(0, 2.0, dtype=torch.float64)
    fine.extras[REC]["b"] = torch.full((4,), 2.0, dtype=torch.float64)
    cast = conform_dtypes(fine, dtypes)
    # keyed as a global array: its dtype; any other stays as sent
    assert cast.extras[REC]["a"].dtype == torch.float32
    assert cast.extras[REC]["b"].dtype == torch.float64
    assert torch.equal(cast.extras[REC]["a"], torch.full((2, 3), 2.0))
    huge = _update(1, 1.0, dtype=torch.float64)
    huge.extras[REC]["a"][0, 0] = 1e300  # finite in float64, Inf in float32
    with pytest.raises(
        ReplyValidationError,
        match=r"record 'delta': 'a' \(float64\) overflows float32",
    ):
        conform_dtypes(huge, dtypes)
    other = _update(2, 1.0)
    other.extras[REC]["b"] = torch.full((4,), 1e300, dtype=torch.float64)
    assert conform_dtypes(other, dtypes).extras[REC]["b"][0] == 1e300


def test_clip_record_scales_to_ratio_times_the_median_and_keeps_the_factor():
    updates = [_update(i, s) for i, s in enumerate([1.0, 2.0, 3.0, 10.0])]
    norms = [record_norm(u.extras[REC]) for u in updates]
    median = sorted(norms)[1]  # torch's median of four: the lower one
    out, reasons = clip_record(updates, REC, ratio=1.5)
    bound = 1.5 * median
    for before, after, norm in zip(updates, out, norms, strict=True):
        if norm <= bound:
            assert after is before and REC not in after.record_factors
        else:
            g = after.record_factors[REC]
            assert g == pytest.approx(bound / norm, rel=1e-15)
            assert record_norm(after.extras[REC]) == pytest.approx(bound, rel=1e-6)
    # 1.5 x the median (2 sqrt(10)) is 3 sqrt(10), node 2's own norm: only
    # node 3 is clipped
    assert [r.split(":")[0] for r in reasons] == ["node 3"]


def test_max_weight_ratio_caps_every_weight_at_a_multiple_of_the_median():
    updates = [_update(i, 1.0, n=n) for i, n in enumerate([100, 200, 300, 400, 5000])]
    space = ParameterSpace({"w": torch.zeros(3)})
    out = robust_aggregate(updates, space, RobustConfig(max_weight_ratio=1.0))
    claimed = torch.tensor([100.0, 200, 300, 400, 5000], dtype=torch.float64)
    capped = claimed.clamp(max=300.0)  # the lower median of five: 300
    expected = capped * claimed.sum() / capped.sum()
    got = torch.tensor([u.weight for u in out.updates], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-15, atol=0)
    assert out.metrics["robust-capped"] == 2.0  # 400 and 5000
    # the claimant weighs what the median client does, whatever it claims
    assert got[4] == got[2]


def test_clip_ratio_sets_norm_clips_bound_relative_to_the_median():
    space = ParameterSpace({"w": torch.zeros(3)})
    updates = [
        ClientUpdate.of_arrays({"w": torch.full((3,), s)}, node_id=i)
        for i, s in enumerate([1.0, 2.0, 3.0, 8.0])
    ]
    median = 2.0 * math.sqrt(3)  # torch's median of four norms: the lower one
    out = robust_aggregate(updates, space, RobustConfig("norm-clip", clip_ratio=2.0))
    norms = [space.norm(u) for u in out.updates]
    assert norms[:3] == pytest.approx([math.sqrt(3), median, 3 * math.sqrt(3)])
    assert norms[3] == pytest.approx(2.0 * median, rel=1e-12)


@pytest.mark.parametrize(
    ("field", "value", "key"),
    [("clip_ratio", 0.0, "clip-ratio"), ("max_weight_ratio", -1.0, "max-weight-ratio")],
)
def test_bad_ratios_are_named(field, value, key):
    with pytest.raises(ConfigError, match=key):
        RobustConfig(**{field: value})

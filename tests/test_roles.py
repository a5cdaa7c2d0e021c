"""The head-role figures (vit_mnist/analysis/roles.py): the digits' parts, and the shares
of attention on them, checked on shapes and attention maps whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vit_mnist.analysis.roles import ROLE_COLUMNS, digit_parts, head_roles, skeleton_points
from vit_mnist.models.vit import VisionTransformer


def _mask(*boxes: tuple[slice, slice]) -> np.ndarray:
    ink = np.zeros((28, 28), bool)
    for rows, cols in boxes:
        ink[rows, cols] = True
    return ink


def test_a_straight_stroke_has_two_ends_and_no_curve():
    ends, curves = skeleton_points(_mask((slice(4, 24), slice(12, 15))))
    found = np.argwhere(ends)
    assert len(found) == 2 and set(found[:, 1]) == {13}  # the bar's middle column
    assert found[:, 0].min() <= 5 and found[:, 0].max() >= 21  # at its top and bottom
    assert not curves.any()


def test_an_l_has_its_corner_as_the_one_curve():
    ends, curves = skeleton_points(
        _mask((slice(4, 22), slice(6, 9)), (slice(19, 22), slice(6, 22)))
    )
    assert ends.sum() == 2
    (corner,) = np.argwhere(curves)
    assert abs(corner[0] - 20) <= 2 and abs(corner[1] - 7) <= 2


def test_a_ring_has_no_end():
    yy, xx = np.mgrid[:28, :28]
    radius = np.hypot(yy - 14, xx - 14)
    ends, curves = skeleton_points((radius > 6) & (radius < 9))
    assert not ends.any() and curves.any()


def test_digit_parts_are_counted_per_patch_in_the_models_order():
    pixels = torch.zeros(2, 28, 28)
    pixels[0, 14:21, 21:28] = 1.0  # image 0: ink fills patch (2, 3) of a 4 x 4 grid
    parts = digit_parts(pixels, patch_size=7)
    assert parts.ink.shape == (2, 16)
    assert parts.ink[0].nonzero().flatten().tolist() == [2 * 4 + 3]
    assert not parts.ink[1].any()
    # The ink's centre is that patch's centre: distance 0 there, 7 pixels to its neighbours.
    assert parts.centre_distance[0, 11] == pytest.approx(0.0, abs=1e-5)
    assert parts.centre_distance[0, 10] == pytest.approx(7.0, abs=1e-5)
    # A blank image is measured from the image's centre, (13.5, 13.5).
    assert parts.centre_distance[1, 0] == pytest.approx(np.hypot(10.5, 10.5), abs=1e-4)
    with pytest.raises(ValueError, match="patch_size=5"):
        digit_parts(pixels, patch_size=5)


def _model_with_cls_attention(cls_row: torch.Tensor) -> VisionTransformer:
    """A 2-layer model whose every head's CLS row is ``cls_row`` (1 + 16 tokens) and whose
    other rows are uniform."""
    torch.manual_seed(0)
    model = VisionTransformer(patch_size=7, embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0)

    def forward_with_attention(x):
        w = torch.full((len(x), 2, 17, 17), 1 / 17)
        w[:, :, 0] = cls_row
        return torch.zeros(len(x), 10), [w, w]

    model.forward_with_attention = forward_with_attention
    return model


def test_shares_of_a_head_on_the_ink_and_of_a_uniform_head():
    pixels = torch.zeros(3, 1, 28, 28)
    pixels[:, 0, 0:7, 0:14] = 1.0  # ink fills patches 0 and 1: 2 of 16
    images = torch.randn(3, 1, 28, 28)
    on_ink = torch.zeros(17)
    on_ink[0], on_ink[1], on_ink[2] = 0.5, 0.25, 0.25  # CLS to itself, then patches 0 and 1
    rows = head_roles(_model_with_cls_attention(on_ink), images, pixels)
    assert [(r["layer"], r["head"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert set(rows[0]) == {"layer", "head", *ROLE_COLUMNS}
    for r in rows:
        assert r["ink_share"] == pytest.approx(1.0)  # renormalised over the patches
        assert r["ink_area"] == pytest.approx(2 / 16)
        assert r["centre_distance_px"] == pytest.approx(3.5, abs=1e-4)  # centre at (3, 6.5)
        assert r["centre_distance_px"] < r["centre_distance_uniform_px"]
    uniform = head_roles(_model_with_cls_attention(torch.full((17,), 1 / 17)), images, pixels)
    for r in uniform:
        assert r["ink_share"] == pytest.approx(r["ink_area"])
        assert r["centre_distance_px"] == pytest.approx(r["centre_distance_uniform_px"])
        assert r["end_share"] == pytest.approx(r["end_area"])
        assert r["entropy_nats"] == pytest.approx(np.log(17), rel=1e-5)
    # All attention on the patch that holds the ink's centre of mass: distance 0 there.
    centred = torch.zeros(3, 1, 28, 28)
    centred[:, 0, 14:21, 21:28] = 1.0  # ink fills patch (2, 3): token 1 + 11
    on_centre = torch.zeros(17)
    on_centre[1 + 11] = 1.0
    for r in head_roles(_model_with_cls_attention(on_centre), images, centred):
        assert r["centre_distance_px"] == pytest.approx(0.0, abs=1e-5)
        assert r["ink_share"] == pytest.approx(1.0) and r["ink_area"] == pytest.approx(1 / 16)
    with pytest.raises(ValueError, match="same N"):
        head_roles(_model_with_cls_attention(on_ink), images, pixels[:2])


def test_head_roles_reports_each_batch_and_batching_does_not_change_the_figures():
    torch.manual_seed(0)
    model = VisionTransformer(patch_size=7, embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0)
    pixels = (torch.rand(5, 1, 28, 28) > 0.7).float()  # scattered ink: ends and curves
    images = (pixels - 0.1307) / 0.3081
    calls = []
    rows = head_roles(model, images, pixels, batch_size=2, progress=lambda: calls.append(1))
    assert len(calls) == 3  # batches of 2, 2 and 1 images
    whole = head_roles(model, images, pixels, batch_size=5)
    for r, w in zip(rows, whole, strict=True):
        assert {k: r[k] for k in ROLE_COLUMNS} == pytest.approx(
            {k: w[k] for k in ROLE_COLUMNS}, abs=2e-5
        )

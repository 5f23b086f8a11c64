"""ds4's direction file and sidecar, the direction math, and the errors for bad files and scales."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch

from dwarfstar.steering.direction import (
    FORMAT,
    SteeringError,
    SteeringScale,
    build_direction,
    read_direction,
    sidecar_path,
    steer,
    write_direction,
)


def ds4_bytes(rows: list[list[float]]) -> bytes:
    """ds4's layout spelled out: every layer's hidden values in order, little-endian float32."""
    return b"".join(struct.pack(f"<{len(row)}f", *row) for row in rows)


ROWS = [[0.5, -1.25, 3.0], [1e-7, 2.0**-20, -0.0], [7.0, 8.5, -9.75], [0.1, 0.2, 0.3]]


def test_written_file_is_ds4_layout(tmp_path):
    path = tmp_path / "dir.f32"
    write_direction(path, torch.tensor(ROWS), "attn_out", {"think": False})
    assert path.read_bytes() == ds4_bytes(ROWS)
    assert path.stat().st_size == 4 * 3 * 4
    sidecar = json.loads(sidecar_path(path).read_text())
    assert sidecar["format"] == "ds4-directional-steering-v1" == FORMAT
    assert sidecar["shape"] == [4, 3] and sidecar["component"] == "attn_out" and sidecar["think"] is False


def test_ds4_file_reads_back_exactly(tmp_path):
    path = tmp_path / "ds4.f32"
    path.write_bytes(ds4_bytes(ROWS))
    sidecar_path(path).write_text(json.dumps({"format": FORMAT, "shape": [4, 3], "component": "attn_out", "k": 1}))
    direction = read_direction(path, 4, 3)
    want = [[struct.unpack("<f", struct.pack("<f", v))[0] for v in row] for row in ROWS]
    assert direction.vectors.dtype == torch.float32 and direction.vectors.tolist() == want
    assert direction.component == "attn_out" and direction.settings == {"k": 1}


def test_missing_sidecar_takes_the_defaults(tmp_path):
    path = tmp_path / "bare.f32"
    path.write_bytes(ds4_bytes(ROWS))
    direction = read_direction(path, 4, 3)
    assert direction.component == "ffn_out" and direction.settings == {}


def test_wrong_size_names_both_shapes(tmp_path):
    path = tmp_path / "flash.f32"
    path.write_bytes(bytes(43 * 4096 * 4))
    flash = r"704512 bytes \(\[43, 4096\], DeepSeek V4 Flash's shape\); this model needs \[61, 4096\]"
    with pytest.raises(SteeringError, match=flash):
        read_direction(path, 61, 4096)
    path.write_bytes(bytes(4 * 2 * 6 * 4))
    sidecar_path(path).write_text(json.dumps({"format": FORMAT, "shape": [8, 6]}))
    with pytest.raises(SteeringError, match=r"\(\[8, 6\] by its sidecar\); this model needs \[4, 3\]"):
        read_direction(path, 4, 3)
    sidecar_path(path).unlink()
    path.write_bytes(bytes(20))
    with pytest.raises(SteeringError, match="5 float32 values.*needs \\[2, 3\\]"):
        read_direction(path, 2, 3)
    path.write_bytes(bytes(10))
    with pytest.raises(SteeringError, match="not whole float32 values.*needs \\[2, 3\\]"):
        read_direction(path, 2, 3)


def test_nan_values_are_refused(tmp_path):
    path = tmp_path / "nan.f32"
    rows = [row[:] for row in ROWS]
    rows[2][1] = math.nan
    path.write_bytes(ds4_bytes(rows))
    with pytest.raises(SteeringError, match="NaN or infinite values \\(first at layer 2, dim 1\\)"):
        read_direction(path, 4, 3)


def test_bad_sidecars_are_refused(tmp_path):
    path = tmp_path / "dir.f32"
    path.write_bytes(ds4_bytes(ROWS))
    for meta, message in [
        ({"format": "other"}, "is not 'ds4-directional-steering-v1'"),
        ({"format": FORMAT, "shape": [3, 4]}, "says shape \\[3, 4\\]; this model needs \\[4, 3\\]"),
        ({"format": FORMAT, "component": "mlp"}, "names component 'mlp'"),
    ]:
        sidecar_path(path).write_text(json.dumps(meta))
        with pytest.raises(SteeringError, match=message):
            read_direction(path, 4, 3)
    sidecar_path(path).write_text("{not json")
    with pytest.raises(SteeringError, match="cannot read steering sidecar"):
        read_direction(path, 4, 3)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(SteeringError, match="cannot read steering file"):
        read_direction(tmp_path / "absent.f32", 4, 3)


@pytest.mark.parametrize("value", [100.5, -101, math.nan, math.inf])
def test_scale_out_of_range(value):
    with pytest.raises(SteeringError, match="between -100 and 100"):
        SteeringScale(ffn=value)
    with pytest.raises(SteeringError, match="attention steering scale"):
        SteeringScale(attn=value)


def test_scales_at_the_limits_and_zero_are_one_key():
    assert SteeringScale(100, -100).at("ffn_out") == 100 and SteeringScale(100, -100).at("attn_out") == -100
    assert SteeringScale(-0.0, 0.0) == SteeringScale() and SteeringScale().off and not SteeringScale(0, 1e-9).off


def test_direction_is_the_unit_difference_of_means():
    # means: good [1, 2, 0], bad [0, 1, 0]; difference [1, 1, 0]
    good = torch.tensor([[[1.0, 1.0, 0.0]], [[1.0, 3.0, 0.0]]])
    bad = torch.tensor([[[0.0, 1.0, 1.0]], [[0.0, 1.0, -1.0]]])
    kept = build_direction(good, bad, remove_bad_projection=False)
    assert torch.allclose(kept, torch.tensor([[1.0, 1.0, 0.0]]) / math.sqrt(2))
    # the unit bad mean is [0, 1, 0]: without it [1, 0, 0] remains
    removed = build_direction(good, bad, remove_bad_projection=True)
    assert torch.allclose(removed, torch.tensor([[1.0, 0.0, 0.0]]))


def test_equal_means_give_a_zero_row_not_nan():
    acts = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    assert build_direction(acts, acts.flip(0)).tolist() == [[0.0, 0.0]]


def test_unpaired_activations_are_refused():
    with pytest.raises(SteeringError, match="do not pair up"):
        build_direction(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5))


def test_steer_removes_or_amplifies_the_component():
    y = torch.tensor([[3.0, 4.0, 0.0], [-1.0, 2.0, 5.0]])
    v = torch.tensor([1.0, 0.0, 0.0])
    assert steer(y, v, torch.tensor([1.0])).tolist() == [[0.0, 4.0, 0.0], [0.0, 2.0, 5.0]]
    assert steer(y, v, torch.tensor([-1.0])).tolist() == [[6.0, 4.0, 0.0], [-2.0, 2.0, 5.0]]
    # per-row scales: row 0 at 0.5, row 1 at 0
    assert steer(y, v, torch.tensor([0.5, 0.0])).tolist() == [[1.5, 4.0, 0.0], [-1.0, 2.0, 5.0]]


def test_the_saved_states_tag_names_the_directions_content_and_both_scales(tmp_path):
    from dwarfstar.steering.apply import SteeringOptions

    first, second = tmp_path / "a.f32", tmp_path / "b.f32"
    first.write_bytes(struct.pack("<4f", 1, 0, 0, 0))
    second.write_bytes(struct.pack("<4f", 0, 1, 0, 0))
    tag = SteeringOptions(first).tag()
    assert tag.endswith("ffn 1 attn 0") and tag == SteeringOptions(first, 1.0, 0.0).tag()
    assert SteeringOptions(first, 0.5).tag() != tag and SteeringOptions(second).tag() != tag
    with pytest.raises(SteeringError, match="cannot read"):
        SteeringOptions(tmp_path / "missing.f32").tag()

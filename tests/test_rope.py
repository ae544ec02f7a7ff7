import torch

from charengine import fp8
from charengine.characters.spec import PRESETS
from charengine.characters.config import CacheSpec
from charengine.characters.rope import RopeTables
from charengine.rope import cos_sin, rotate, rotate_temporal_f32


def test_delta_rotation_equals_rope_at_shifted_positions():
    spec, cc = PRESETS["characters-57b"], CacheSpec()
    rope = RopeTables(spec)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, spec.tokens_per_frame, spec.head_dim, generator=g)
    for t in (cc.first_temporal_index + cc.reset_period - 1, 43, 48):
        at_t = rotate(x, *cos_sin(rope.frame_angles(torch.tensor(t))))
        shifted = rotate(x, *cos_sin(rope.frame_angles(torch.tensor(t + cc.delta))))
        delta = rotate_temporal_f32(at_t, rope.omega_t, float(cc.delta))
        assert (delta - shifted).abs().max() < 1e-6 * max(1.0, shifted.abs().max())
        # only the temporal pairs move
        nt = 2 * rope.omega_t.shape[0]
        assert torch.equal(delta[..., nt:], at_t[..., nt:])


def test_fp8_delta_rotation_is_one_rounding():
    spec = PRESETS["characters-57b"]
    rope = RopeTables(spec)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(4, 757, spec.head_dim, generator=g) * 3
    scale = k.abs().amax(dim=(1, 2), keepdim=True) * 1.5 / fp8.FP8_MAX
    stored = fp8.quantize(k, scale)
    exact = rotate_temporal_f32(fp8.dequantize(stored, scale), rope.omega_t, -42.0)
    new = fp8.quantize(exact, scale)
    err = (fp8.dequantize(new, scale) - exact).abs()
    # one e4m3 rounding: half a unit in the last place of the exact value (3 mantissa bits),
    # at least half the subnormal step
    mag = (exact / scale).abs().clamp_min(2.0 ** -6)
    half_ulp = 2.0 ** (torch.floor(torch.log2(mag)) - 4) * scale
    assert (err <= half_ulp * (1 + 1e-6)).all()
    assert (err > 0).any()  # the check can fail: rotated keys do get rounded

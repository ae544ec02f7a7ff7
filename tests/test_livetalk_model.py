"""The LiveTalk family's DiT and step on tiny-livetalk: the checkpoint layout, the plain path
pinned (it equals upstream's model and loop bit for bit in bf16 on the same weights and
noise; the fixtures below were taken after that check), every switch against the plain path
over many chunks and position resets, FP8 against fp32, and a session past 1,100 latent
frames with bounded positions."""

import dataclasses
import itertools

import pytest
import torch
from safetensors.torch import save_file

from charengine.assemble import rank_session
from charengine.checkpoint import CheckpointError
from charengine.config import EngineConfig, Numerics
from charengine.family import family
from charengine.livetalk.spec import LIVETALK_1_3B, TINY, LiveTalkSwitches
from charengine.livetalk.weights import load_checkpoint, param_shapes
from charengine.mapping import Mapping

FAM = family("livetalk")
FP32 = Numerics(dtype="float32", fp8_gemm=False, fp8_attention=False)
FAST_FP32 = dataclasses.replace(LiveTalkSwitches(), fp8_kv=False)  # every switch but FP8 KV
FP8_CROSS_REL = 0.03  # the FP8 cross-attention's bound against SDPA over the same prompt


def session(switches, numerics=FP32, spec=TINY, seed=0):
    cfg = EngineConfig(model=spec, switches=switches, numerics=numerics)
    full = FAM.random_weights(spec, seed)
    tables = FAM.bake_tables(cfg, full) if switches.baked_adaln else None
    s = rank_session(cfg, FAM.rank_state(cfg, full), Mapping.single("cpu"), tables=tables)
    g = torch.Generator().manual_seed(1)
    s.start(torch.randn(spec.latent_channels, spec.latent_h, spec.latent_w, generator=g),
            torch.randn(spec.prompt_tokens, spec.text_dim, generator=g))
    return s


def inputs(spec, n, seed=2):
    g = torch.Generator().manual_seed(seed)
    shapes = FAM.step_shapes(spec)
    return [(torch.randn(shapes.noise_shape, generator=g),
             torch.randn(shapes.features, generator=g)) for _ in range(n)]


def rollout(s, ins):
    with torch.inference_mode():
        return [s.step(n, a) for n, a in ins]


def test_the_released_layout_has_upstreams_tensor_count_and_parameters():
    shapes = param_shapes(LIVETALK_1_3B)
    assert len(shapes) == 857
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 1_421_187_232
    assert shapes["blocks.29.self_attn.q.weight"] == (1536, 1536)
    assert shapes["audio_proj.proj.weight"] == (32, 43008)
    assert shapes["audio_cond_projs.13.weight"] == (1536, 32)
    assert shapes["patch_embedding.weight"] == (1536, 33, 1, 2, 2)
    assert LIVETALK_1_3B.rope_split == (44, 42, 42)
    assert LIVETALK_1_3B.frame_tokens == 1024 and LIVETALK_1_3B.cache_frames == 15


def test_schedule_is_the_warped_four_passes_with_bf16_timesteps():
    cfg = EngineConfig(model=TINY)
    assert cfg.schedule.timesteps == (1000.0, 936.0, 832.0, 624.0)
    assert [round(s, 6) for s in cfg.schedule.sigmas] == [1.0, 0.9375, 0.833333, 0.625]


# the plain path (all switches off, fp32) on seeded tiny-livetalk: per chunk, the latent's
# sum and mean |x| (taken after the bit-exact bf16 check against upstream's code)
PLAIN_FIXTURE = [(16.343, 0.91371), (-225.186, 0.99785), (52.782, 0.95636)]


def test_plain_path_is_pinned():
    s = session(LiveTalkSwitches.baseline())
    outs = rollout(s, inputs(TINY, 3))
    got = [(round(float(o.sum()), 3), round(float(o.abs().mean()), 5)) for o in outs]
    assert PLAIN_FIXTURE is not None, got
    for (sum_, mean), (fs, fm) in zip(got, PLAIN_FIXTURE):
        assert sum_ == pytest.approx(fs, abs=2e-3) and mean == pytest.approx(fm, abs=2e-5)


def test_first_chunk_keeps_the_reference_latent_as_frame_zero():
    s = session(FAST_FP32)
    out = rollout(s, inputs(TINY, 1))[0]
    assert torch.equal(out[:, 0], s.cache.ref.float())


@pytest.mark.parametrize("arm", LiveTalkSwitches.ORDER)
def test_each_switch_holds_to_the_plain_path_across_resets(arm):
    """Every arm of the waterfall against the plain path with the same position policy, 14
    chunks (four resets) in fp32."""
    reset = dataclasses.replace(LiveTalkSwitches.baseline(), position_reset=True)
    sw = dataclasses.replace(LiveTalkSwitches.cumulative(arm), position_reset=True, fp8_kv=False)
    ins = inputs(TINY, 14)
    plain, fast = rollout(session(reset), ins), rollout(session(sw), ins)
    for a, b in zip(plain, fast):
        assert (a - b).abs().max() < 1e-4, arm


def test_the_ring_equals_sliding_the_window():
    base = LiveTalkSwitches.baseline()
    ins = inputs(TINY, 9)
    slide = rollout(session(base), ins)
    ring = rollout(session(dataclasses.replace(base, ring_cache=True)), ins)
    for a, b in zip(slide, ring):
        assert (a - b).abs().max() < 1e-5


def test_without_the_reset_positions_grow_as_upstreams_do():
    s = session(dataclasses.replace(FAST_FP32, position_reset=False))
    rollout(s, inputs(TINY, 9))
    assert s.cache.positions.tolist() == [24, 25, 26]


def test_fp8_weights_activations_and_kv_stay_near_fp32():
    ins = inputs(TINY, 12)
    ref = rollout(session(FAST_FP32), ins)
    fp8 = rollout(session(LiveTalkSwitches(), Numerics(dtype="bfloat16")), ins)
    for a, b in zip(ref, fp8):
        rel = (a - b).norm() / a.norm()
        assert rel < 0.1, float(rel)


def test_the_fp8_cross_attention_stays_near_sdpa_over_the_same_prompt():
    """With FP8 numerics, the cross-attention by the FP8 kernel over the prompt's K/V
    quantized at session start (fp8_cross_attention) against SDPA in bf16 over the same
    K/V: 12 chunks (two resets), each moved by less than twice FP8's own distance from fp32
    (1.3-1.7% for these weights without the switch; 1.3-1.6% between the two)."""
    nm = Numerics(dtype="bfloat16")
    ins = inputs(TINY, 12)
    on = session(LiveTalkSwitches(), nm)
    off = session(dataclasses.replace(LiveTalkSwitches(), fp8_cross_attention=False), nm)
    assert on.cache.text8 is not None and off.cache.text8 is None
    for a, b in zip(rollout(on, ins), rollout(off, ins)):
        rel = float((a - b).norm() / b.norm())
        assert 0 < rel < FP8_CROSS_REL, rel


def test_a_session_past_1100_latent_frames_keeps_positions_bounded():
    spec = TINY
    s = session(LiveTalkSwitches(), Numerics(dtype="bfloat16"))
    seen = set()
    chunks = 1101 // spec.chunk_frames + 1
    with torch.inference_mode():
        for i, (n, a) in enumerate(inputs(spec, chunks)):
            out = s.step(n, a)
            seen.update(s.cache.positions.tolist())
            assert torch.isfinite(out).all(), i
    assert s.k * spec.chunk_frames > 1100
    assert max(seen) == spec.sink_frames + (s.cfg.cache.reset_period + 1) * spec.chunk_frames - 1
    assert max(seen) < 21  # within the latent frames the model was trained on


def test_checkpoint_mismatches_are_one_line_naming_the_tensor(tmp_path):
    full = FAM.random_weights(TINY, 0)
    good = tmp_path / "ok.safetensors"
    save_file(full, str(good))
    assert set(load_checkpoint(good, TINY)) == set(full)
    cases = {
        "missing": ({k: v for k, v in full.items() if k != "blocks.3.ffn.0.bias"},
                    "missing tensor 'blocks.3.ffn.0.bias'"),
        "extra": (full | {"blocks.0.self_attn.extra": torch.zeros(1)},
                  "unexpected tensor 'blocks.0.self_attn.extra'"),
        "shape": (full | {"head.head.weight": torch.zeros(3, 3)}, "'head.head.weight' has shape"),
        "dtype": (full | {"head.modulation": torch.zeros(1, 2, TINY.dim, dtype=torch.int32)},
                  "'head.modulation' has dtype"),
        "nan": (full | {"audio_cond_projs.1.bias": torch.full((TINY.dim,), float("nan"))},
                "'audio_cond_projs.1.bias' holds"),
    }
    for name, (state, says) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(state, str(path))
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(path, TINY)
        assert says in str(e.value) and "\n" not in str(e.value), name


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_graphed_chunks_replay_what_eager_chunks_compute_on_a_gpu(fp8):
    """tiny-livetalk on the GPU: every chunk (those that fill the cache, the steady and the
    reset ones) replayed from CUDA graphs captured in a warm-up session against a new
    session stepped eagerly, 14 chunks (four resets): the graphs read this session's
    reference, prompt and caches."""
    sw = LiveTalkSwitches() if fp8 else FAST_FP32
    nm = Numerics(dtype="bfloat16") if fp8 else Numerics(dtype="bfloat16", fp8_gemm=False,
                                                         fp8_attention=False)
    cfg = EngineConfig(model=TINY, switches=sw, numerics=nm)
    full = FAM.random_weights(TINY, 0)
    outs = {}
    for graphed in (False, True):
        s = rank_session(cfg, FAM.rank_state(cfg, full), Mapping.single("cuda"),
                         tables=FAM.bake_tables(cfg, full), graphed=graphed)
        if graphed:  # as charrun does: the graphs come from a warm-up session of other inputs
            FAM.warm_up(s)
        g = torch.Generator().manual_seed(1)
        with torch.inference_mode():  # as charrun's worker steps a session
            s.start(torch.randn(16, TINY.latent_h, TINY.latent_w, generator=g),
                    torch.randn(TINY.prompt_tokens, TINY.text_dim, generator=g))
            outs[graphed] = [o.cpu() for o in rollout(s, [(n.cuda(), a.cuda())
                                                          for n, a in inputs(TINY, 14)])]
        if graphed:
            fill = set(range(s.cache.first_steady()))
            assert set(s.step_fn.graphs) == fill | {"steady", "reset"} and fill
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)


def test_the_fused_pre_attention_equals_the_unfused_path_on_the_cpu():
    """With the FP8 cache in use, the fused pre-attention's reference (what the CPU runs)
    gives the unfused path's chunks exactly, across a reset."""
    ins = inputs(TINY, 10)
    nm = Numerics(dtype="bfloat16")
    fused = rollout(session(LiveTalkSwitches(), nm), ins)
    apart = rollout(session(dataclasses.replace(LiveTalkSwitches(), fused_pre_attention=False),
                            nm), ins)
    for a, b in zip(fused, apart):
        assert torch.equal(a, b)


def test_the_fused_pre_attention_into_the_wide_cache_equals_the_unfused_path_on_the_cpu():
    """Into the cache in the model's dtype (every chunk without fp8_kv), the fused
    pre-attention's reference gives the unfused path's chunks exactly, across resets."""
    ins = inputs(TINY, 10)
    nm = Numerics(dtype="bfloat16", fp8_gemm=False, fp8_attention=False)
    sw = dataclasses.replace(LiveTalkSwitches(), fp8_kv=False)
    fused = rollout(session(sw, nm), ins)
    apart = rollout(session(dataclasses.replace(sw, fused_wide_pre_attention=False), nm), ins)
    for a, b in zip(fused, apart):
        assert torch.equal(a, b)


@pytest.mark.parametrize("switch", ["fused_gelu_quant", "fused_q_norm",
                                    "fused_wide_pre_attention", "fused_calibration",
                                    "fused_delta_rotation"])
def test_the_fused_epilogues_equal_the_unfused_path_on_the_cpu(switch):
    """GELU + quantize, the q norm kernel, the pre-attention of the chunks before the FP8
    calibration, the calibration's kernels and the delta rotation's: their references (what
    the CPU runs) are the unfused path's math, so the chunks are equal, across a reset."""
    ins = inputs(TINY, 8)
    nm = Numerics(dtype="bfloat16")
    fused = rollout(session(LiveTalkSwitches(), nm), ins)
    apart = rollout(session(dataclasses.replace(LiveTalkSwitches(), **{switch: False}), nm), ins)
    for a, b in zip(fused, apart):
        assert torch.equal(a, b)


def test_the_fused_residual_moves_only_roundings():
    """The gated residuals added inside the next norm's kernel round once (as addcmul) where
    the unfused path rounds the product and then the sum: per chunk, across resets, the two
    differ by less than the FP8 path's own distance from fp32, and the fused one is no
    farther from fp32 than that distance and half again."""
    ins = inputs(TINY, 10)
    nm = Numerics(dtype="bfloat16")
    ref = rollout(session(FAST_FP32), ins)
    fused = rollout(session(LiveTalkSwitches(), nm), ins)
    apart = rollout(session(dataclasses.replace(LiveTalkSwitches(), fused_residual=False), nm),
                    ins)
    for r, a, b in zip(ref, fused, apart):
        moved, err = float((a - b).norm() / r.norm()), float((b - r).norm() / r.norm())
        assert 0 < moved < err
        assert float((a - r).norm() / r.norm()) < 1.5 * err


@pytest.mark.parametrize("fast", [True, False])
def test_the_gemm_problems_are_timed_as_the_model_accumulates(fast):
    """charbuild times each FP8 linear kind with the accumulation the model runs it with
    (every LiveTalk linear follows numerics.fast_accum), so its choice is for that GEMM."""
    cfg = EngineConfig(model=TINY, switches=LiveTalkSwitches(),
                       numerics=Numerics(dtype="bfloat16", fast_accum=fast))
    state = FAM.rank_state(cfg, FAM.random_weights(TINY, 0))
    probs = FAM.gemm_problems(cfg, state, Mapping.single("cpu"))
    assert set(probs) == {"qkv", "attn", "ffn_up", "ffn_down"}
    assert all(p.fast_accum is fast for p in probs.values())


def test_the_cache_calibrates_and_rotates_block_by_block_as_the_whole_cache_at_once():
    """The FP8 calibration and the delta rotation run one block at a time (so their fp32
    temporaries are one block's), over stores shared or apart, through the plugins' plain
    references (what the CPU runs for the fused switches too): the scales, the calibrated
    slots of the FP8 cache and the rotated keys equal the same math over every block at
    once."""
    from charengine import fp8
    from charengine.livetalk.cache import ChunkCache
    from charengine.livetalk.rope import rotate_temporal

    for shared, fused in itertools.product((True, False), (True, False)):
        sw = dataclasses.replace(LiveTalkSwitches(), shared_kv_stores=shared,
                                 fused_calibration=fused, fused_delta_rotation=fused)
        cfg = EngineConfig(model=TINY, switches=sw, numerics=Numerics())
        cache = ChunkCache(cfg, "cpu", torch.bfloat16)
        assert cache.shared == shared
        g = torch.Generator().manual_seed(3)
        # blocks and heads of different ranges, so a scale from the wrong one shows
        spread = torch.logspace(-1, 1, TINY.n_blocks * TINY.n_heads).view(
            TINY.n_blocks, TINY.n_heads, 1, 1)
        cache.k.copy_(torch.randn(cache.k.shape, generator=g) * spread)
        cache.v.copy_(torch.randn(cache.v.shape, generator=g) * spread.flip(0))
        k, v = cache.k.clone(), cache.v.clone()
        n = cache.valid_slots(cfg.cache.calibration_chunks - 1)
        cache.calibrate(n)
        amax = torch.stack([k[:, :, :n].float().abs().amax(dim=(2, 3)),
                            v[:, :, :n].float().abs().amax(dim=(2, 3))], dim=1)
        scale = (amax.clamp_min(fp8.TINY) * cfg.cache.scale_margin / fp8.FP8_MAX)[..., None, None]
        assert torch.equal(cache.scale, scale) and cache.quantized
        # the kernels and their reference quantize the slots written (the slots past them
        # are written by every chunk before it reads them)
        assert torch.equal(cache.k8[:, :, :n].float(),
                           fp8.quantize(k[:, :, :n], scale[:, 0]).float())
        assert torch.equal(cache.v8[:, :, :, :n].float(),
                           fp8.quantize(v[:, :, :n], scale[:, 1]).transpose(2, 3).float())

        lo, delta = cache.sink_slots, -float(cache.R * cache.F)
        k8 = cache.k8.clone()
        cache.delta_rotate()
        # (the slots past the calibration's are written before any chunk reads them: with
        # shared stores they hold the wide cache's bytes until then)
        rot = rotate_temporal(k8[:, :, lo:n].float() * scale[:, 0], cache.rope.omega_t, delta)
        assert torch.equal(cache.k8[:, :, lo:n].float(), fp8.quantize(rot, scale[:, 0]).float())
        assert torch.equal(cache.k8[:, :, :lo], k8[:, :, :lo])  # the sink stays

    # the rotation of the cache in the model's dtype (the chunks before the calibration)
    cache = ChunkCache(EngineConfig(model=TINY, switches=LiveTalkSwitches(),
                                    numerics=Numerics()), "cpu", torch.bfloat16)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    k = cache.k.clone()
    cache.delta_rotate()
    assert torch.equal(cache.k[:, :, lo:],
                       rotate_temporal(k[:, :, lo:], cache.rope.omega_t, delta))
    assert not torch.equal(cache.k[:, :, lo:], k[:, :, lo:])


def test_shared_kv_stores_hold_less_and_step_the_same_chunks():
    """With shared_kv_stores the cache in the model's dtype holds only the calibration
    chunks' slots, in the FP8 cache's bytes: at livetalk-1.3b's shapes the stores hold 2,160
    MiB against 4,050 apart, tiny-livetalk's storages are what kv_bytes says, and a
    session's chunks are the same bit for bit, across resets."""
    from charengine.livetalk.cache import ChunkCache

    apart = dataclasses.replace(LiveTalkSwitches(), shared_kv_stores=False)
    held = {}
    for sw in (LiveTalkSwitches(), apart):
        big = ChunkCache(EngineConfig(model=LIVETALK_1_3B, switches=sw, numerics=Numerics()),
                         "meta", torch.bfloat16)
        held[sw.shared_kv_stores] = big.kv_bytes()
        tiny = ChunkCache(EngineConfig(model=TINY, switches=sw, numerics=Numerics()), "cpu",
                          torch.bfloat16)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (tiny.k, tiny.v, tiny.k8, tiny.v8)}
        assert sum(storages.values()) == tiny.kv_bytes()
        assert len(storages) == (2 if sw.shared_kv_stores else 4)
    blocks_heads_dim = 30 * 12 * 128
    assert held == {True: 2 * blocks_heads_dim * 12288 * 2,  # bf16, the calibration's slots
                    False: 2 * blocks_heads_dim * 15360 * (2 + 1)}  # bf16 and FP8, all slots
    ins = inputs(TINY, 10)
    nm = Numerics(dtype="bfloat16")
    shared = rollout(session(LiveTalkSwitches(), nm), ins)
    separate = rollout(session(apart, nm), ins)
    for a, b in zip(shared, separate):
        assert torch.equal(a, b)

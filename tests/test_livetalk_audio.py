"""LiveTalk's audio features and prompt (CPU, tiny random networks): the live window against
the whole-clip (OmniAvatar) path, chunk bounds, liveness, loading, the prompt sources."""

import dataclasses
import math

import pytest
import torch

from charengine.checkpoint import CheckpointError
from charengine.livetalk import audio as A
from charengine.livetalk.text import (TinyUmt5Prompt, load_prompt_embeddings,
                                      save_prompt_embeddings)

LATENTS = 12  # 45 video frames, 2.75 s: four chunks
WIDE = dataclasses.replace(A.TINY, context_frames=48, lookahead_frames=48)  # covers the clip


def speechlike(n: int, seed: int = 1) -> torch.Tensor:
    """A voiced tone with harmonics, syllable-rate envelope and pauses, plus noise."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n, dtype=torch.float64) / 16000
    phase = 2 * math.pi * torch.cumsum(140 + 40 * torch.sin(2 * math.pi * 0.7 * t), 0) / 16000
    voiced = sum(torch.sin(h * phase) / h for h in range(1, 6))
    env = (0.5 + 0.5 * torch.sin(2 * math.pi * 4 * t)) ** 2 * (torch.sin(2 * math.pi * t) > -0.6)
    return (0.3 * env * voiced + 0.02 * torch.randn(n, generator=g, dtype=torch.float64)).float()


@pytest.fixture(scope="module")
def encoder():
    return A.AudioEncoder(A.TINY, seed=0)


@pytest.fixture(scope="module")
def speech():
    return speechlike((4 * LATENTS - 4) * 1000 + 5000)  # runs past the clip's end


def clip_of(speech):
    return A.Clip.of(A.TINY, speech.numel(), LATENTS)


def test_spec_shapes():
    assert A.BASE_960H.feature_dim == 14 * 768 == 10752
    assert A.BASE_960H.cnn_stride == A.TINY.cnn_stride == 320
    assert A.BASE_960H.cnn_field == A.TINY.cnn_field == 400
    assert A.TINY.feature_dim == 4 * 32
    s = A.AudioSpec(**json_round_trip(dataclasses.asdict(A.BASE_960H)))
    assert s == A.BASE_960H and isinstance(s.conv_dim, tuple)


def json_round_trip(d):
    import json

    return json.loads(json.dumps(d))


def test_window_covering_the_clip_equals_whole_clip(encoder, speech):
    ref = A.whole_clip_features(A.TINY, encoder, speech, LATENTS)
    assert ref.shape == (4 * LATENTS, A.TINY.feature_dim)
    assert torch.equal(ref[0], ref[3]) and not torch.equal(ref[3], ref[4])
    for k in range(LATENTS // 3):
        win = A.chunk_window(WIDE, speech, k)
        got = A.chunk_features(WIDE, encoder, win, k, clip=clip_of(speech))
        want = ref[12 * k:12 * k + 12]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_short_window_differs_but_is_finite(encoder, speech):
    ref = A.whole_clip_features(A.TINY, encoder, speech, LATENTS)
    for clip in (None, clip_of(speech)):
        for k in range(LATENTS // 3):
            got = A.chunk_features(A.TINY, encoder, A.chunk_window(A.TINY, speech, k), k, clip)
            assert got.shape == (12, A.TINY.feature_dim)
            assert torch.isfinite(got).all()
        assert (got - ref[-12:]).abs().max() > 1e-3


def test_silence_is_finite(encoder):
    win = torch.zeros(A.window_samples(A.TINY))
    for k in (0, 1, 5):
        assert torch.isfinite(A.chunk_features(A.TINY, encoder, win, k)).all()


def test_chunk_bounds():
    assert A.chunk_frames(0) == (0, 9)
    assert A.chunk_frames(1) == (9, 21)
    assert A.chunk_frames(3) == (33, 45)
    assert A.chunk_samples(A.TINY, 0) == (0, 9000)
    assert A.chunk_samples(A.TINY, 2) == (21000, 33000)
    assert [A.steps_for(A.TINY, n) for n in (0, 1, 9000, 9001, 21000, 21001)] == [1, 1, 1, 2, 2, 3]
    spec = A.TINY
    size = A.window_samples(spec)
    assert size == (spec.context_frames + 12 + spec.lookahead_frames) * 1000
    w0 = A.window_bounds(spec, 0)
    assert (w0.a, w0.b, w0.first_frame) == (0, (9 + spec.lookahead_frames) * 1000, 0)
    for k in range(1, 6):
        w = A.window_bounds(spec, k)
        assert w.b == (A.chunk_frames(k)[1] + spec.lookahead_frames) * 1000
        assert w.a == max(0, w.b - size) and w.end_frame * 1000 == w.b
    assert A.chunk_window(spec, torch.ones(3000), 4).shape == (size,)


def test_chunk_window_is_a_live_history(speech):
    """A live session keeps the last window_samples heard; step k has heard up to its window's
    end (chunk 0 takes its lookahead too)."""
    spec = A.TINY
    history = torch.zeros(A.window_samples(spec))
    heard = 0
    for k in range(6):
        end = A.window_bounds(spec, k).b
        got = speech[heard:end]
        got = torch.nn.functional.pad(got, (0, end - heard - got.numel()))
        history = torch.cat([history, got])[-history.numel():]
        heard = end
        assert torch.equal(history, A.chunk_window(spec, speech, k))


@pytest.mark.parametrize("clip", [False, True])
def test_features_are_live(encoder, speech, clip):
    """Chunk k's features read no speech past its window's end (chunk end + lookahead)."""
    clip = clip_of(speech) if clip else None
    for k in range(3):
        end = A.window_bounds(A.TINY, k).b
        later = speech.clone()
        later[end:] = torch.randn(later.numel() - end)
        a = A.chunk_features(A.TINY, encoder, A.chunk_window(A.TINY, speech, k), k, clip)
        b = A.chunk_features(A.TINY, encoder, A.chunk_window(A.TINY, later, k), k, clip)
        assert torch.equal(a, b)
        earlier = speech.clone()
        earlier[end - 200:end] += 0.5
        c = A.chunk_features(A.TINY, encoder, A.chunk_window(A.TINY, earlier, k), k, clip)
        assert not torch.equal(a, c)


def test_from_pretrained_round_trip(encoder, speech, tmp_path):
    encoder.save_pretrained(tmp_path / "w2v")
    back = A.AudioEncoder.from_pretrained(tmp_path / "w2v", A.TINY)
    sd, sd2 = encoder.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(k.startswith("model.") for k in sd)
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    clip = speech[:20000]
    torch.testing.assert_close(back.features(clip, 21), encoder.features(clip, 21))
    fresh = A.AudioEncoder(A.TINY, seed=5)
    key = "model.masked_spec_embed"
    assert not torch.equal(fresh.state_dict()[key], sd[key])
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.features(clip, 21), encoder.features(clip, 21))


def test_the_runtimes_wav2vec2_computes_what_transformers_computes(encoder, speech):
    """The runtime's own wav2vec2 (charengine/livetalk/wav2vec2.py, no transformers import)
    against transformers' Wav2Vec2Model on the same weights: the offline features, a live
    window with padding masked out (chunk 0) and a full one, in float32; and its state dict
    is transformers' own, key for key."""
    plain = A.AudioEncoder(A.TINY, model=encoder.transformers_model())
    assert type(plain.model).__name__ == "Wav2Vec2Model"
    assert type(encoder.model).__module__ == "charengine.livetalk.wav2vec2"
    sd, ref = encoder.state_dict(), plain.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in sd)
    clip = speech[:20000]
    torch.testing.assert_close(encoder.features(clip, 21), plain.features(clip, 21),
                               atol=1e-5, rtol=1e-5)
    for k in (0, 3):
        window = A.chunk_window(A.TINY, speech, k)
        torch.testing.assert_close(A.chunk_features(A.TINY, encoder, window, k),
                                   A.chunk_features(A.TINY, plain, window, k),
                                   atol=1e-5, rtol=1e-5)
    # a control: the same comparison sees one changed weight
    other = A.AudioEncoder(A.TINY, seed=None)
    other.load_state_dict({**sd, "model.encoder.layers.1.final_layer_norm.bias":
                           sd["model.encoder.layers.1.final_layer_norm.bias"] + 1e-3})
    assert not torch.allclose(other.features(clip, 21), plain.features(clip, 21),
                              atol=1e-5, rtol=1e-5)


def test_from_pretrained_errors(encoder, tmp_path):
    with pytest.raises(CheckpointError) as e:
        A.AudioEncoder.from_pretrained(tmp_path / "nowhere", A.TINY)
    assert "\n" not in str(e.value) and "no such" in str(e.value)
    encoder.save_pretrained(tmp_path / "w2v")
    with pytest.raises(CheckpointError) as e:
        A.AudioEncoder.from_pretrained(tmp_path / "w2v", dataclasses.replace(A.TINY, layers=3))
    assert "\n" not in str(e.value) and "num_hidden_layers" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        A.AudioEncoder.from_pretrained(tmp_path / "w2v", A.BASE_960H)
    assert "\n" not in str(e.value) and "does not match" in str(e.value)


def test_prompt_embeddings_file(tmp_path):
    states = torch.randn(8, 16)
    save_prompt_embeddings(tmp_path / "p.safetensors", states)
    assert torch.equal(load_prompt_embeddings(tmp_path / "p.safetensors", 8, 16), states)
    from safetensors.torch import save_file

    save_file({"x": states[None].bfloat16()}, str(tmp_path / "b.safetensors"))
    assert load_prompt_embeddings(tmp_path / "b.safetensors", 8, 16).dtype == torch.float32
    for name, bad in [("shape", {"x": torch.randn(8, 15)}),
                      ("two", {"x": states, "y": states.clone()})]:
        save_file(bad, str(tmp_path / f"{name}.safetensors"))
        with pytest.raises(CheckpointError) as e:
            load_prompt_embeddings(tmp_path / f"{name}.safetensors", 8, 16)
        assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError):
        load_prompt_embeddings(tmp_path / "missing.safetensors", 8, 16)


def test_tiny_umt5_prompt():
    a, b = TinyUmt5Prompt(32, 16, seed=3), TinyUmt5Prompt(32, 16, seed=3)
    prompt = "A woman  talks,\n smiling"
    x = a.encode(prompt)
    n = len("A woman talks, smiling") + 1  # cleaned bytes and the end token
    assert x.shape == (32, 16) and x.dtype == torch.float32
    assert int(a.ids(prompt)[1].sum()) == n
    assert torch.equal(x[n:], torch.zeros(32 - n, 16)) and (x[:n].abs().sum(-1) > 0).all()
    assert torch.equal(x, b.encode(prompt))
    assert not torch.equal(x, TinyUmt5Prompt(32, 16, seed=4).encode(prompt))
    long = a.encode("x" * 100)
    assert (long.abs().sum(-1) > 0).all()  # truncated to the tokens, the end token kept


# chunk 1's rows for AudioEncoder(TINY, seed=0) on speechlike(), live window: a change to the
# features' semantics (mapping, masking, normalization, layout) moves these
PINNED = ([-0.700701, 0.979002, -1.180135, 0.702612, 0.714772, -0.696146, -0.84114, 2.66199,
           0.55874, 1.002202, -0.949938, -0.816075], 1251.6129)


def test_pinned_chunk_features(encoder, speech):
    got = A.chunk_features(A.TINY, encoder, A.chunk_window(A.TINY, speech, 1), 1)
    picks = torch.stack([got[0, :4], got[5, 60:64], got[11, -4:]]).flatten()
    torch.testing.assert_close(picks, torch.tensor(PINNED[0]), atol=1e-4, rtol=1e-4)
    assert abs(got.double().abs().sum().item() - PINNED[1]) < 1e-2


# ---- the steady window's graph (audio_graph.py) ---------------------------------------------
def test_the_first_full_chunk_is_the_first_without_padding():
    from charengine.livetalk.audio_graph import first_full_chunk

    for spec in (A.TINY, A.BASE_960H):
        k = first_full_chunk(spec)
        for j, whole in ((k - 1, False), (k, True), (k + 5, True)):
            w = A.window_bounds(spec, j)
            assert (w.b - w.a == A.window_samples(spec)) is whole, (spec.name, j)
    assert first_full_chunk(A.BASE_960H) == 6  # 80 frames of window, 9 + 12 k + 4 past 80


def test_every_chunk_from_the_first_full_one_is_one_computation_of_its_window(encoder, speech):
    """What the graph replays for every steady chunk: chunk_features of chunk k's window is
    steady_rows of that window, whatever k, bit for bit; the chunk before is not."""
    from charengine.livetalk.audio_graph import SteadyAudio, first_full_chunk, steady_rows

    k0 = first_full_chunk(A.TINY)
    steady = SteadyAudio(A.TINY, encoder)  # not captured (a CPU): chunk_features eagerly
    pos = A.window_positions(A.TINY, A.window_bounds(A.TINY, k0), None)
    long = torch.cat([speech, speech])
    for k in (k0, k0 + 1, k0 + 4):
        window = A.chunk_window(A.TINY, long, k)
        want = A.chunk_features(A.TINY, encoder, window, k)
        assert torch.equal(steady_rows(A.TINY, encoder, window, pos), want)
        assert torch.equal(steady(window, k), want)
    window = A.chunk_window(A.TINY, long, k0 - 1)
    assert not torch.equal(steady_rows(A.TINY, encoder, window, pos),
                           A.chunk_features(A.TINY, encoder, window, k0 - 1))


def test_the_steady_window_traces_whole_as_its_graph_captures_it(encoder, speech):
    """What the audio graph captures, traced on the CPU: the steady window's encoder in one
    graph with no break (no host sync or branch on a value), equal to the eager rows, and
    traced once for every steady chunk."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from charengine.livetalk.audio_graph import first_full_chunk, steady_rows

    k0 = first_full_chunk(A.TINY)
    pos = A.window_positions(A.TINY, A.window_bounds(A.TINY, k0), None)
    graphs = CompileCounterWithBackend("aot_eager")
    traced = torch.compile(steady_rows, fullgraph=True, dynamic=False, backend=graphs)
    long = torch.cat([speech, speech])
    with torch.inference_mode():
        for k in (k0, k0 + 1, k0 + 4):
            window = A.chunk_window(A.TINY, long, k)
            assert torch.equal(traced(A.TINY, encoder, window, pos),
                               A.chunk_features(A.TINY, encoder, window, k)), k
    assert graphs.frame_count == 1


def test_side_networks_graph_the_audio_only_on_a_gpu():
    from charengine.livetalk.sidenets import SideNets
    from charengine.livetalk.spec import TINY

    side = SideNets(TINY).eval().ready()
    assert side.steady_audio is None  # a CPU: eager, whatever the switch says
    window = torch.randn(A.window_samples(TINY.audio), generator=torch.Generator().manual_seed(3))
    assert torch.equal(side.audio_features(window, 7),
                       A.chunk_features(TINY.audio, side.audio_encoder, window, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-livetalk", "livetalk-1.3b"])
def test_the_audio_graph_replays_what_the_encoder_computes_on_a_gpu(preset):
    """The side networks as a worker loads them on a GPU (the graph captured at warm-up):
    every chunk's features equal the eager encoder's, the steady ones replayed, for
    windows that change from call to call."""
    from charengine.livetalk import FAMILY
    from charengine.livetalk.spec import PRESETS

    from charengine.livetalk.sidenets import load_side
    from charengine.livetalk.warmup import warm_up_side

    spec, dev = PRESETS[preset], torch.device("cuda")
    side = load_side(spec, FAMILY.random_side_state(spec, 0), dev)
    warm_up_side(side, spec, dev)
    assert side.steady_audio is not None and side.steady_audio.graph is not None
    speech = speechlike(A.window_samples(spec.audio) * 3).to(dev)
    with torch.inference_mode():
        for k in range(side.steady_audio.first + 3):
            window = A.chunk_window(spec.audio, speech, k)
            got = side.audio_features(window, k)
            want = A.chunk_features(spec.audio, side.audio_encoder, window, k)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- the encoder in bf16 (LiveTalkSwitches.audio_bf16) ----------------------------------------
# Bound on the features' relative L2 error against fp32: bf16 rounds each op's result to
# within u = 2^-9 relative; the encoder's 12 layers (base-960h) and its CNN round some 240
# results on the way to a feature, and independent roundings add in quadrature:
# sqrt(240) * u = 3.0e-2.
BF16_FEATURES_REL = math.sqrt(240) * 2 ** -9


def bf16_copy(encoder):
    import copy

    return copy.deepcopy(encoder).to(torch.bfloat16)


def rel_l2(a, ref):
    return float((a.float() - ref.float()).norm() / ref.float().norm())


def test_the_audio_encoder_runs_in_bf16_on_a_gpu_by_its_switch_and_nowhere_else():
    from charengine.livetalk.sidenets import load_side, random_side_state, side_dtypes
    from charengine.livetalk.spec import TINY, LiveTalkSwitches

    off = dataclasses.replace(LiveTalkSwitches(), audio_bf16=False)
    assert side_dtypes(TINY, "cuda")["audio_encoder."] == torch.bfloat16
    assert "audio_encoder." not in side_dtypes(TINY, "cuda", off)
    assert side_dtypes(TINY, "cuda", off)["vae."] == side_dtypes(TINY, "cuda")["vae."]
    assert side_dtypes(TINY, "cpu") == {}
    side = load_side(TINY, random_side_state(TINY, 0), "cpu")
    assert {p.dtype for p in side.audio_encoder.parameters()} == {torch.float32}


def test_the_bf16_encoder_at_the_released_shapes_stays_near_fp32():
    """wav2vec2-base-960h's shapes (random weights), a steady chunk of speech: the bf16
    features within BF16_FEATURES_REL of fp32 (measured 1.3e-2), and more than one rounding
    away (bf16 really ran)."""
    from charengine.livetalk.audio_graph import first_full_chunk

    spec = A.BASE_960H
    enc = A.AudioEncoder(spec, seed=0).eval()
    k = first_full_chunk(spec)
    window = A.chunk_window(spec, speechlike(A.window_samples(spec) * 2, seed=3), k)
    with torch.inference_mode():
        ref = A.chunk_features(spec, enc, window, k)
        got = A.chunk_features(spec, bf16_copy(enc), window, k)
    assert got.dtype == torch.bfloat16
    assert 2 ** -9 < rel_l2(got, ref) < BF16_FEATURES_REL


def test_the_bf16_encoder_moves_the_chunks_less_than_the_dits_own_numerics():
    """The tiny LiveTalk DiT with its production numerics (bf16, FP8), stepped over 12 chunks
    of speech encoded in fp32 and in bf16: the latents' difference stays below what those
    numerics carry against fp32 (measured 1.5e-2 against 1.9e-2), chunk by chunk. The tiny
    encoder takes 16 channels a group in its positional conv here: torch's CPU bf16 grouped
    conv1d with kernel 128 and 2 to 6 channels a group (the tiny spec's 2) is wrong by the
    whole signal (base-960h's 48 a group is right)."""
    from test_livetalk_model import FAST_FP32, FP32, session

    from charengine.config import Numerics
    from charengine.family import family
    from charengine.livetalk.spec import TINY, LiveTalkSwitches

    spec = dataclasses.replace(A.TINY, pos_conv_groups=2)
    enc = A.AudioEncoder(spec, seed=0).eval()
    enc16 = bf16_copy(enc)
    speech = speechlike(A.window_samples(spec) * 8, seed=3)
    shapes = family("livetalk").step_shapes(TINY)
    g = torch.Generator().manual_seed(2)
    steps = []
    with torch.inference_mode():
        for k in range(12):
            window = A.chunk_window(spec, speech, k)
            f32, f16 = (A.chunk_features(spec, e, window, k) for e in (enc, enc16))
            assert rel_l2(f16, f32) < BF16_FEATURES_REL
            steps.append((torch.randn(shapes.noise_shape, generator=g), f32, f16))

    def rollout(switches, numerics, which):
        s = session(switches, numerics)
        with torch.inference_mode():
            return [s.step(n, f[which].reshape(shapes.features)) for n, *f in steps]

    production = Numerics(dtype="bfloat16")
    ref = rollout(LiveTalkSwitches(), production, 0)
    bf16_audio = rollout(LiveTalkSwitches(), production, 1)
    fp32 = rollout(FAST_FP32, FP32, 0)
    for a, b, c in zip(ref, bf16_audio, fp32):
        assert 0 < rel_l2(b, a) < rel_l2(a, c)


@pytest.mark.gpu
def test_the_bf16_audio_graph_stays_near_the_fp32_encoder_on_a_gpu():
    """livetalk-1.3b's side networks as a worker loads them (bf16, the graph captured) against
    the fp32 encoder eagerly: every chunk's features within BF16_FEATURES_REL."""
    from charengine.livetalk import FAMILY
    from charengine.livetalk.sidenets import load_side
    from charengine.livetalk.spec import LIVETALK_1_3B as spec, LiveTalkSwitches
    from charengine.livetalk.warmup import warm_up_side

    dev = torch.device("cuda")
    state = FAMILY.random_side_state(spec, 0)
    side = load_side(spec, state, dev)
    warm_up_side(side, spec, dev)
    plain = load_side(spec, state, dev, LiveTalkSwitches.baseline())
    assert next(side.audio_encoder.parameters()).dtype == torch.bfloat16
    assert next(plain.audio_encoder.parameters()).dtype == torch.float32
    speech = speechlike(A.window_samples(spec.audio) * 3).to(dev)
    with torch.inference_mode():
        for k in range(side.steady_audio.first + 3):
            window = A.chunk_window(spec.audio, speech, k)
            assert rel_l2(side.audio_features(window, k),
                          plain.audio_features(window, k)) < BF16_FEATURES_REL, k

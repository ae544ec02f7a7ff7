"""The training forward (all frames of a clip at once) against the engine's AR steps."""

import torch

from charengine import fp8
from charengine.config import preset
from charengine.characters.config import Switches
from charengine.characters.model import patchify
from charengine.assemble import rank_session, rank_state
from charengine.mapping import Mapping
from tinychar.sequence import SequenceDiT, block_causal_mask
from charengine.characters.weights import block_linear_names, random_weights
from rollout import FP32, session_inputs

STEPS = 10  # the window of 6 fills, then the ring wraps


def test_block_causal_mask():
    m = block_causal_mask(G=2, T=1, frames=4, window=2)
    want = torch.tensor([[1, 1, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0],
                         [1, 1, 1, 1, 0, 0],
                         [1, 1, 0, 1, 1, 0],
                         [1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, want)


def test_sequence_forward_equals_the_engines_steps():
    cfg = preset("tiny", numerics=FP32, switches=Switches(fp8_kv=False))
    spec = cfg.model
    full = random_weights(spec, 0)
    state = rank_state(cfg, full)
    s = rank_session(cfg, state, Mapping.single())
    seen = []  # (pass, input tokens, velocity) of every forward the engine runs
    forward = s.model.forward_frame

    def recorded(x, p, cond, cache, mask=None, slots=None):
        v = forward(x, p, cond, cache, mask, slots)
        seen.append((p, x.clone(), v.clone()))
        return v

    s.model.forward_frame = recorded
    ref, prompt, noise, audio = session_inputs(spec, STEPS)
    with torch.no_grad():
        s.start(ref, prompt)
        for k in range(STEPS):
            s.step(noise[k], audio[k])
        # the sequence model gets the weights the engine runs: block linears through FP8
        weights = dict(full)
        for n in block_linear_names(spec):
            weights[n] = fp8.dequantize(state[f"{n}.q"], state[f"{n}.scale"][:, None])
        seq = SequenceDiT(cfg, weights)
        temporal = (cfg.cache.first_temporal_index + torch.arange(STEPS))[None]
        for p, sigma in enumerate(cfg.schedule.sigmas):
            xs = torch.stack([x for q, x, _ in seen if q == p])[None]
            want = torch.stack([v for q, _, v in seen if q == p])[None]
            got = seq(xs, audio[None], patchify(ref, spec.patch)[None], prompt[None],
                      torch.tensor([sigma]), temporal)
            err = (got - want).norm() / want.norm()
            assert err < 1e-5, f"pass {p}: {err:.2e}"

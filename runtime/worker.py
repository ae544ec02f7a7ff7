"""A worker holding one loaded engine (TP-1, in this process): it starts sessions from a
reference image, a prompt and speech, and runs them through the pipeline."""

from __future__ import annotations

import torch

from charengine import audio as audio_mod
from charengine.config import RankShape
from charengine.model import CharacterDiT
from charengine.cache import KVCache
from charengine.sidenets import load_side
from charengine.step import Session

from .engine import Engine, EngineError
from .pipeline import Pipeline, StepTimes


class Worker:
    def __init__(self, engine: Engine):
        cfg = self.cfg = engine.config
        if cfg.tp != 1:
            raise EngineError(f"engine {engine.target.name} is TP-{cfg.tp}: this charrun runs "
                              "TP-1 engines in one process")
        devices = engine.target.rank_devices()
        self.device = torch.device(devices["tp"][0])
        self.decoder_device = torch.device(devices["decoder"])
        spec = cfg.model
        shape = RankShape.of(spec, 1, 0)
        model = CharacterDiT(cfg, shape, engine.rank_state(0), adaln_tables=engine.adaln_tables(),
                             device=self.device)
        self.session = Session(model, KVCache(cfg, shape.heads, self.device))
        self.side = load_side(spec, engine.side_state(), self.decoder_device)
        self.spec = spec

    def close(self) -> None:
        """Nothing to release (a DistributedWorker stops its rank processes here)."""

    @torch.inference_mode()
    def start(self, image: torch.Tensor, prompt: str) -> None:
        """New session: encode the reference image and prompt into the global slots."""
        ref = self.side.image_encoder(image.to(self.decoder_device))
        text = self.side.text_encoder(prompt)
        self.session.start(ref.to(self.device), text.to(self.device))
        self.side.decoder.reset()

    def pipeline(self, encode_audio, seed: int = 0) -> Pipeline:
        """The three-stage pipeline over this worker's session, with rank 0's audio encoding
        given by `encode_audio(i)`."""
        spec = self.spec
        g = torch.Generator(device=self.device).manual_seed(seed)
        shape = (spec.latent_channels, spec.latent_h, spec.latent_w)

        def diffuse(i, feats):
            noise = torch.randn(shape, generator=g, device=self.device)
            return self.session.step(noise, feats.to(self.device))

        def decode(latent):
            return self.side.decoder(latent.to(self.decoder_device)).cpu()

        return Pipeline(encode_audio, diffuse, decode)

    def run(self, speech: torch.Tensor, steps: int, sink, seed: int = 0) -> StepTimes:
        """Generate `steps` latents for `speech` (16 kHz mono) and hand each step's frames to
        `sink(i, frames)`."""
        def encode_audio(i):
            w = audio_mod.step_window(self.spec, speech, i).to(self.decoder_device)
            return self.side.audio_encoder(w)

        return self.pipeline(encode_audio, seed).run(steps, sink)

"""LiveTalk's side networks as one module tree, so an engine stores and loads them as one
state dict: the Wan 2.1 VAE (`vae.`: the reference image's encoder, once per session, and
the streaming decoder), wav2vec2 (`audio_encoder.`), and the prompt (`prompt.`: one
prompt's umT5 features, made at build; with a tiny-umt5 spec also a small umT5 encoder,
`umt5.`, that encodes any prompt).

`load_side_files` reads them from the files a user has: `Wan2.1_VAE.pth` (torch.load with
weights_only), a wav2vec2 directory (transformers), and the prompt as a safetensors file of
umT5 features or through a local umT5 encoder directory."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import CheckpointError, check_tensors
from .audio import AudioEncoder
from .audio_graph import SteadyAudio
from .spec import LiveTalkSpec, LiveTalkSwitches
from .vae import StreamingDecoder, WanVAE, encode_image, load_vae
from .vae_blocks import use_frames_layout, use_fused_norms, use_row_kernels

PREFIXES = ("vae.", "audio_encoder.", "prompt.", "umt5.")


class SideNets(torch.nn.Module):
    def __init__(self, spec: LiveTalkSpec, audio_seed: int | None = 0):
        """`audio_seed`: the audio encoder's random initialization (None: its tensors are left
        for a state to fill, as on the meta device)."""
        super().__init__()
        from .text import TinyUmt5Prompt

        self.spec = spec
        self.vae = WanVAE(spec.vae)
        self.audio_encoder = AudioEncoder(spec.audio, seed=audio_seed)
        self.prompt = torch.nn.Module()
        self.prompt.register_buffer("features", torch.zeros(spec.prompt_tokens, spec.text_dim))
        self.prompt_encoder = TinyUmt5Prompt(spec.prompt_tokens, spec.text_dim) \
            if spec.text_encoder == "tiny-umt5" else None
        self.umt5 = self.prompt_encoder.model if self.prompt_encoder is not None else None
        self.decoder: StreamingDecoder | None = None  # made on the networks' device (ready())
        # the audio encoder's steady chunks as a graph (ready(); captured by warm_up_side)
        self.steady_audio: SteadyAudio | None = None

    def ready(self, switches: LiveTalkSwitches | None = None) -> SideNets:
        """After a move to the serving device: the streaming decoder over the moved VAE, its
        implementation on a GPU chosen once by the decoder's switches (`switches`' DECODER
        fields; None: the preset's), and the audio encoder's by its (AUDIO)."""
        sw = switches if switches is not None else LiveTalkSwitches()
        if self.vae.conv2.weight.device.type == "cuda":
            if sw.vae_frames_layout:
                use_frames_layout(self.vae.decoder)
                if sw.vae_row_kernels:
                    use_row_kernels(self.vae.decoder)
            if sw.vae_fused_norm:
                use_fused_norms(self.vae)
        on_gpu = next(self.audio_encoder.parameters()).device.type == "cuda"
        self.steady_audio = SteadyAudio(self.spec.audio, self.audio_encoder) \
            if on_gpu and sw.audio_graph else None
        self.decoder = StreamingDecoder(self.vae)
        return self

    def audio_features(self, window: torch.Tensor, k: int) -> torch.Tensor:
        """Chunk k's audio feature rows from its encoder window (audio.chunk_features; the
        steady chunks a graph's replay where one is captured)."""
        if self.steady_audio is not None:
            return self.steady_audio(window, k)
        from .audio import chunk_features

        return chunk_features(self.spec.audio, self.audio_encoder, window, k)

    def image_encoder(self, image: torch.Tensor) -> torch.Tensor:
        """The reference image [3, H, W] in [0, 1] -> its normalized latent [C, h, w]."""
        return encode_image(self.vae, image.to(self.prompt.features.device))

    def text_encoder(self, prompt: str) -> torch.Tensor:
        """The prompt's features [prompt_tokens, text_dim]: encoded where the engine has an
        encoder, else the features the engine was built with (for any prompt)."""
        if self.prompt_encoder is not None and prompt:
            return self.prompt_encoder.encode(prompt).to(self.prompt.features.device)
        return self.prompt.features


def session_decoder(side: SideNets) -> StreamingDecoder:
    """A streaming decoder of its own (its causal state) over the side networks' VAE."""
    return StreamingDecoder(side.vae)


def side_shapes(spec: LiveTalkSpec) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in SideNets(spec, audio_seed=None).state_dict().items()}


def check_side(spec: LiveTalkSpec, state: dict, where: str) -> None:
    check_tensors(side_shapes(spec), state, where, f"{spec.name}'s side networks")


def random_side_state(spec: LiveTalkSpec, seed: int) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        nets = SideNets(spec)
        nets.prompt.features.normal_()
        return {k: v.detach().clone() for k, v in nets.state_dict().items()}


def side_dtypes(spec: LiveTalkSpec, device,
                switches: LiveTalkSwitches | None = None) -> dict[str, torch.dtype]:
    """Name prefix -> the dtype its floating tensors run in on `device`: on a GPU the VAE in
    its GPU dtype and the audio encoder in bf16 with `switches.audio_bf16` (None: the
    preset's); every other tensor as stored."""
    if torch.device(device).type != "cuda":
        return {}
    sw = switches if switches is not None else LiveTalkSwitches()
    return {"vae.": getattr(torch, spec.vae.gpu_dtype),
            **({"audio_encoder.": torch.bfloat16} if sw.audio_bf16 else {})}


def load_side(spec: LiveTalkSpec, state: dict, device="cpu",
              switches: LiveTalkSwitches | None = None) -> SideNets:
    """The side networks over `state`'s own tensors: the modules are made on the meta device
    (no random initialization, no copy into it) and take the state's tensors, moved to
    `device` and its dtypes (side_dtypes) where they are not there yet; a state read
    straight onto the device is used as it lies. `switches`: the engine's (the decoder's
    implementation; None: the preset's)."""
    with torch.device("meta"):
        nets = SideNets(spec, audio_seed=None)
    names = set(nets.state_dict())
    missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise ValueError(f"side networks: {'missing' if missing else 'unexpected'} tensor {name!r}")
    device, dtypes = torch.device(device), side_dtypes(spec, device, switches)

    def placed(name: str, t: torch.Tensor) -> torch.Tensor:
        dtype = next((d for p, d in dtypes.items() if name.startswith(p)), t.dtype)
        return t.to(device, dtype if t.is_floating_point() else t.dtype)

    nets.load_state_dict({k: placed(k, v) for k, v in state.items()}, assign=True)
    left = next((k for k, t in [*nets.named_parameters(), *nets.named_buffers()]
                 if t.is_meta), None)
    if left is not None:  # a tensor no state holds (a buffer left out of the state dict)
        raise ValueError(f"side networks: {left!r} is not in the engine's state")
    return nets.eval().ready(switches)


def load_side_files(spec: LiveTalkSpec, vae: Path | None, wav2vec: Path | None,
                    prompt_features: Path | None = None, text_encoder: Path | None = None,
                    prompt: str = "", seed: int = 0) -> dict[str, torch.Tensor]:
    """The engine's side state from the user's files; a network whose file is not given is
    random (seeded), for builds of random weights. One CheckpointError line for a bad file."""
    state = random_side_state(spec, seed)
    if vae is not None:
        state |= {f"vae.{k}": v for k, v in load_vae(vae, spec.vae).items()}
    if wav2vec is not None:
        enc = AudioEncoder.from_pretrained(wav2vec, spec.audio)
        state |= {f"audio_encoder.{k}": v for k, v in enc.state_dict().items()}
    if prompt_features is not None and text_encoder is not None:
        raise CheckpointError("give the prompt as features or through a text encoder, not both")
    if prompt and text_encoder is None:
        raise CheckpointError("--prompt is encoded at build by --text-encoder DIR (a umT5 "
                              "encoder), which was not given; give it, or the prompt's features "
                              "with --prompt-features")
    if prompt_features is not None:
        from .text import load_prompt_embeddings

        state["prompt.features"] = load_prompt_embeddings(prompt_features, spec.prompt_tokens,
                                                          spec.text_dim).float()
    elif text_encoder is not None:
        from .text import Umt5Prompt

        state["prompt.features"] = Umt5Prompt(text_encoder, spec.prompt_tokens,
                                              spec.text_dim).encode(prompt).float()
    return state

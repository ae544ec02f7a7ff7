"""A Pipecat bot whose character is a local `charrun --serve`: the character speaks what the
visitor says, with no cloud key (the visitor's speech stands in for the bot's TTS).

Three commands (the extra `pipecat` installs Pipecat with its WebRTC transport and its
development runner; the tiny engine runs on a CPU):

    pip install -e '.[pipecat]'
    charbuild --target cpu-tiny --out engines/cpu-tiny &&
        charrun --engine engines/cpu-tiny --serve --port 8080 &
    python examples/pipecat_bot.py --charrun http://127.0.0.1:8080/ --image assets/face.png

then open http://localhost:7860/client/ (Pipecat's prebuilt page) and press Connect. The
pipeline is the visitor's audio (SmallWebRTCTransport), `Echo` (their speech as the bot's
TTS audio), `CharacterVideoService` (the character speaking it) and the transport's output
(the character's video and voice). A real bot puts speech-to-text, an LLM and TTS where
`Echo` is; the README shows that pipeline. When charrun cannot be reached as a visitor comes,
the visitor hears the bot without its character, and one line says why.
"""

import argparse
from pathlib import Path

from loguru import logger
from pipecat.frames.frames import Frame, InputAudioRawFrame, TTSAudioRawFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.runner.types import RunnerArguments
from pipecat.runner.utils import create_transport
from pipecat.transports.base_transport import BaseTransport, TransportParams
from pipecat.workers.runner import WorkerRunner

from charengine.paths import not_a_file
from charengine.pipecat import CharacterVideoService, Refused, Unreachable, engine_info


class Echo(FrameProcessor):
    """The visitor's audio as the bot's speech: each InputAudioRawFrame passes on as a
    TTSAudioRawFrame (what a TTS service would push)."""

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, InputAudioRawFrame):
            frame = TTSAudioRawFrame(audio=frame.audio, sample_rate=frame.sample_rate,
                                     num_channels=frame.num_channels)
        await self.push_frame(frame, direction)


async def run_bot(transport: BaseTransport, args: argparse.Namespace, character: bool):
    video = [CharacterVideoService(args.charrun, args.image, prompt=args.prompt)] \
        if character else []
    pipeline = Pipeline([transport.input(), Echo(), *video, transport.output()])
    worker = PipelineWorker(pipeline, params=PipelineParams(enable_metrics=True))

    @transport.event_handler("on_client_disconnected")
    async def on_client_disconnected(transport, client):
        logger.info("the visitor left")
        await worker.cancel()

    await WorkerRunner(handle_sigint=False).run(worker)


async def bot(runner_args: RunnerArguments):
    """The runner's entry point: one pipeline per visitor, one charrun session each. With no
    charrun to be had, the visitor hears the bot without its character (one line says why)."""
    args = runner_args.cli_args
    try:
        engine = await engine_info(args.charrun)  # the character's frame size and rate
        video = dict(video_out_enabled=True, video_out_is_live=True,
                     video_out_width=engine.width, video_out_height=engine.height,
                     video_out_framerate=engine.fps)
    except (Refused, Unreachable) as e:
        logger.error(f"a visitor hears the bot without its character: {e}")
        engine, video = None, {}
    transport = await create_transport(runner_args, {
        "webrtc": lambda: TransportParams(audio_in_enabled=True, audio_out_enabled=True,
                                          **video)})
    await run_bot(transport, args, character=engine is not None)


def image_file(text: str) -> str:
    """--image: a file, checked as the bot starts rather than as each visitor comes."""
    if (why := not_a_file(Path(text))) is not None:
        raise argparse.ArgumentTypeError(f"{text}: {why}")
    return text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="A Pipecat bot with a charengine character")
    ap.add_argument("--charrun", default="http://127.0.0.1:8080/",
                    help="the page of a running `charrun --serve`")
    ap.add_argument("--image", type=image_file,
                    help="the character's reference image (default: the server's grey frame)")
    ap.add_argument("--prompt", help="the prompt (for engines that take one)")
    return ap


if __name__ == "__main__":
    from pipecat.runner.run import main

    main(parser())

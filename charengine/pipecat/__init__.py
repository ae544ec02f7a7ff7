"""Pipecat integration (the optional extra `charengine[pipecat]`): the character as the video
service of a Pipecat voice bot, from a `charrun --serve` of the bot's own.

    from charengine.pipecat import CharacterVideoService
    video = CharacterVideoService("http://127.0.0.1:8080/", "face.png", prompt="...")
    Pipeline([transport.input(), stt, user_aggregator, llm, tts, video,
              transport.output(), assistant_aggregator])

service.py holds the frame processor, client.py the session it opens (aiortc, no Pipecat)."""

from .client import (CharacterClient, EngineInfo, Refused, SpeechTrack, Unreachable,
                     engine_info)
from .service import CharacterVideoService, Reconnect

__all__ = ["CharacterClient", "CharacterVideoService", "EngineInfo", "Reconnect", "Refused",
           "SpeechTrack", "Unreachable", "engine_info"]

"""Every reader of a file the user names (speech, reference image, checkpoint, LoRA, VAE)
refuses a path that is not a regular file in one line saying what it is instead, before
opening it: a directory, a device (/dev/zero would never end), a pipe (it would block until
someone writes), or nothing at all."""

import os

import pytest

from charengine.checkpoint import CheckpointError, read_safetensors
from charengine.livetalk.vae import load_vae
from charengine.lora import read_lora
from charengine.runtime.formats import MediaError
from charengine.runtime.images import load_image
from charengine.runtime.media import read_audio

DEVICE = "is not a regular file (a device, pipe or socket)"
READERS = {
    "speech": (lambda p: read_audio(p, 16000), MediaError),
    "image": (lambda p: load_image(p, 64, 64), MediaError),
    "checkpoint": (read_safetensors, CheckpointError),
    "lora": (read_lora, CheckpointError),
    "vae": (load_vae, CheckpointError),
}


@pytest.mark.parametrize("reader", READERS)
def test_a_path_that_is_not_a_file_is_one_line_saying_what_it_is(tmp_path, reader):
    read, error = READERS[reader]
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "folder").mkdir()
    cases = {"/dev/zero": DEVICE, tmp_path / "pipe": DEVICE, tmp_path / "absent": "no such file"}
    if reader != "checkpoint":  # a checkpoint may be a folder of shards (test_lora)
        cases[tmp_path / "folder"] = "is a directory, not a file"
    for path, said in cases.items():
        with pytest.raises(error) as refused:
            read(path)
        line = str(refused.value)
        assert line.startswith(f"{path}: {said}") and "\n" not in line, line

"""Every reader of a file the user names (speech, reference image, checkpoint, LoRA, VAE)
refuses a path that is not a regular file in one line saying what it is instead, before
opening it: a directory, a device (/dev/zero would never end), a pipe (it would block until
someone writes), or nothing at all. charrun's and charbuild's path options refuse a name
longer than the file system takes, in one line, before anything looks it up."""

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


LONG = "a" * 300  # a name longer than any Linux file system takes (255 bytes)


@pytest.mark.parametrize("command, args", [
    ("charrun", ["--engine", "eng", "--image", "face.png", "--audio", "s.wav", "--out",
                 f"{LONG}.mp4"]),
    ("charrun", ["--engine", LONG, "--serve"]),
    ("charbuild", ["--target", "cpu-tiny", "--out", f"engines/{LONG}"]),
    ("charbuild", ["--target", "cpu-tiny", "--weights", f"{LONG}.safetensors", "--out", "e"]),
    ("charbuild", ["--target", "cpu-tiny-livetalk", "--vae", LONG, "--out", "e"]),
])
def test_a_name_longer_than_the_file_system_takes_is_a_usage_error(tmp_path, monkeypatch,
                                                                     command, args):
    """Where Python's path checks raise OSError (ENAMETOOLONG), not False: one line naming
    the option, exit 2, nothing made."""
    from click.testing import CliRunner

    from charengine.builder.cli import main as charbuild
    from charengine.runtime.cli import main as charrun

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke({"charrun": charrun, "charbuild": charbuild}[command], args)
    flag = next(a for a, v in zip(args, args[1:]) if LONG in v)
    assert r.exit_code == 2, (r.output, r.exception)
    lines = r.output.strip().splitlines()
    assert lines[-1].startswith(f"Error: Invalid value for '{flag}': the name ") and \
        lines[-1].endswith("bytes long, more than the file system takes (255)"), r.output
    assert list(tmp_path.iterdir()) == []


def test_a_prompt_past_what_is_taken_is_a_usage_error(tmp_path, monkeypatch):
    """charrun --prompt as the server's and LiveKit's prompts (test_server, test_livekit):
    one line, exit 2, before the engine is looked at."""
    from click.testing import CliRunner

    from charengine.runtime.cli import main as charrun
    from charengine.runtime.formats import MAX_PROMPT_CHARS, prompt_problem

    assert prompt_problem("a" * MAX_PROMPT_CHARS) is None
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(charrun, ["--engine", "no-engine", "--serve", "--prompt",
                                     "a" * (MAX_PROMPT_CHARS + 1)])
    assert r.exit_code == 2, (r.output, r.exception)
    assert r.output.strip().splitlines()[-1] == (
        "Error: Invalid value for '--prompt': is 10,001 characters long; at most 10,000 are "
        "taken (the text encoder reads a few hundred tokens)"), r.output


def test_a_name_too_long_to_look_up_is_one_line_where_it_is_read(tmp_path):
    """Past the options (a target's name, a path a library call is given)."""
    from charengine.builder.build_config import find_target

    with pytest.raises(ValueError, match=r"^unknown target 'a{300}'; known targets: "):
        find_target(LONG)
    with pytest.raises(MediaError) as refused:
        read_audio(tmp_path / LONG, 16000)
    assert str(refused.value) == f"{tmp_path / LONG}: cannot be looked up (File name too long)"

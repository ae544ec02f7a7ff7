"""charbuild as a user runs it: --out is replaced only where it is absent, empty or an engine
directory, and a build that fails leaves nothing behind; checkpoints that cannot be right
(non-finite values, a side network of the wrong layout, no side networks) are refused in one
line naming the tensor."""

import json
import signal
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engines import ROOT

CHARBUILD = [sys.executable, "-m", "charengine.builder.cli"]
CHARRUN = [sys.executable, "-m", "charengine.runtime.cli"]
TINY = ROOT / "charengine" / "checkpoints" / "tiny.safetensors"


def charbuild(*args, cwd=None, **kw):
    return subprocess.run(CHARBUILD + ["--target", "cpu-tiny", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300, **kw)


def one_line_error(r) -> str:
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def tree(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_a_folder_of_the_users_is_refused_and_left_as_it_was(tmp_path):
    user = tmp_path / "some" / "user" / "folder"
    user.mkdir(parents=True)
    (user / "thesis.txt").write_text("four years")
    line = one_line_error(charbuild("--out", user))
    assert "holds files and no engine" in line
    assert (user / "thesis.txt").read_text() == "four years"
    assert tree(tmp_path) == ["some", "some/user", "some/user/folder",
                              "some/user/folder/thesis.txt"]


def test_the_parent_and_the_current_directory_are_refused(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "keep.txt").write_text("x")
    (work / "notes.txt").write_text("y")
    for out in ("..", ".", "../work", str(tmp_path)):
        line = one_line_error(charbuild("--out", out, cwd=work))
        assert "current directory or one of its parents" in line
    assert tree(tmp_path) == ["keep.txt", "work", "work/notes.txt"]


def test_an_existing_file_is_refused_and_nothing_is_left_beside_it(tmp_path):
    f = tmp_path / "engine"
    f.write_text("not a directory")
    line = one_line_error(charbuild("--out", f))
    assert "exists and is not a directory" in line
    assert f.read_text() == "not a directory"
    assert tree(tmp_path) == ["engine"]


def test_an_engine_directory_is_replaced_and_a_foreign_file_in_it_stops_that(tmp_path):
    out = tmp_path / "eng"
    assert charbuild("--out", out).returncode == 0
    first = json.loads((out / "manifest.json").read_text())["weights"]
    r = charbuild("--random-weights", "--random-side-networks", "--out", out)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "manifest.json").read_text())["weights"] != first
    assert tree(tmp_path) == ["eng", *(f"eng/{n}" for n in tree(out))]  # nothing beside it
    (out / "mine.txt").write_text("keep")
    line = one_line_error(charbuild("--out", out))
    assert "'mine.txt', which is not part of the engine" in line
    assert (out / "mine.txt").read_text() == "keep"


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    ckpt = tmp_path / "nan.safetensors"
    with safe_open(str(TINY), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    state["blocks.1.w_out"][3, 5] = float("nan")
    save_file(state, str(ckpt))
    line = one_line_error(charbuild("--weights", ckpt, "--out", tmp_path / "new" / "eng"))
    assert "tensor 'blocks.1.w_out' holds 1 non-finite value" in line
    assert tree(tmp_path) == ["nan.safetensors"]  # not even the parent it would have made


def test_sigterm_during_a_build_leaves_nothing_behind(tmp_path):
    p = subprocess.Popen(CHARBUILD + ["--target", "cpu-tiny", "--out", str(tmp_path / "eng")],
                         stderr=subprocess.PIPE, text=True)
    for line in p.stderr:  # the weights are read: the build is writing into its staging
        if "rank 0:" in line:
            break
    p.send_signal(signal.SIGTERM)
    p.wait(30)
    assert p.returncode in (0, 143)  # a build that finished first is fine; a stopped one
    if p.returncode == 143:
        assert tree(tmp_path) == []
    else:
        assert [n for n in tree(tmp_path) if "building" in n] == []


def side_broken(tmp_path, edit) -> str:
    with safe_open(str(TINY), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    edit(state)
    path = tmp_path / "ckpt.safetensors"
    save_file(state, str(path))
    return path


def test_a_side_network_of_the_wrong_shape_is_refused_naming_the_tensor(tmp_path):
    def widen(state):
        name = next(k for k in state if k.startswith("decoder.") and k.endswith("weight"))
        state[name] = torch.zeros(*state[name].shape[:-1], state[name].shape[-1] + 1)
        widen.name = name

    ckpt = side_broken(tmp_path, widen)
    line = one_line_error(charbuild("--weights", ckpt, "--out", tmp_path / "eng"))
    assert f"tensor {widen.name!r} has shape" in line and "side networks needs" in line
    assert not (tmp_path / "eng").exists()


def test_a_checkpoint_without_side_networks_builds_only_when_asked_and_says_so(tmp_path):
    ckpt = side_broken(tmp_path, lambda s: [s.pop(k) for k in list(s) if k.startswith(
        ("audio_encoder.", "decoder.", "image_encoder.", "text_encoder."))])
    line = one_line_error(charbuild("--weights", ckpt, "--out", tmp_path / "eng"))
    assert "holds no side networks" in line and "--random-side-networks" in line
    r = charbuild("--weights", ckpt, "--random-side-networks", "--out", tmp_path / "eng")
    assert r.returncode == 0, r.stderr
    assert "side networks (audio encoder, decoder, image and text encoders) are random" \
        in r.stderr
    assert json.loads((tmp_path / "eng/manifest.json").read_text())["side_networks"] \
        .startswith("random")
    r = subprocess.run(CHARRUN + ["--engine", str(tmp_path / "eng"), "--image",
                                  str(ROOT / "assets/face.png"), "--audio",
                                  str(ROOT / "assets/speech.wav"), "--out",
                                  str(tmp_path / "o.mp4")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "its side networks (audio encoder, decoder, image and text encoders) are random" \
        in r.stderr


def test_the_out_check_comes_before_the_weights_are_read(tmp_path):
    (tmp_path / "f").write_text("x")
    line = one_line_error(charbuild("--out", tmp_path / "f", "--weights",
                                    tmp_path / "absent.safetensors"))
    assert line.startswith("Error: --out") and "absent" not in line, line


def building(out):
    """A charbuild of `out` that has read its weights and is writing into its staging."""
    p = subprocess.Popen(CHARBUILD + ["--target", "cpu-tiny", "--out", str(out)],
                         stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        if "rank 0:" in line:
            return p
    raise AssertionError(f"the build ended early: {p.wait()}")


def test_a_second_build_to_the_same_out_is_refused_while_the_first_writes(tmp_path):
    first = building(tmp_path / "eng")
    first.send_signal(signal.SIGSTOP)  # held mid-build
    try:
        line = one_line_error(charbuild("--out", tmp_path / "eng"))
        assert f"another charbuild is writing it (pid {first.pid})" in line, line
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(120) == 0
    assert (tmp_path / "eng" / "manifest.json").is_file()
    assert [n for n in tree(tmp_path) if n.startswith(".")] == []


def test_a_killed_builds_leftovers_are_removed_by_the_next_build(tmp_path):
    p = building(tmp_path / "eng")
    p.kill()
    p.wait(30)
    assert [n for n in tree(tmp_path) if n.startswith(".eng.")]  # what SIGKILL leaves
    r = charbuild("--out", tmp_path / "eng")
    assert r.returncode == 0, r.stderr
    assert [n for n in tree(tmp_path) if "/" not in n] == ["eng"], tree(tmp_path)


def test_a_build_that_finds_no_room_is_one_line_and_leaves_nothing(tmp_path):
    import resource

    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # noqa: E731
    line = one_line_error(charbuild("--out", tmp_path / "eng", preexec_fn=limit))
    assert "could not be written (a file-size limit" in line and "is as it was" in line, line
    assert tree(tmp_path) == []


def test_the_engine_is_readable_by_every_user(tmp_path):
    import os
    import stat

    assert charbuild("--out", tmp_path / "eng").returncode == 0
    for p in [tmp_path / "eng", *(tmp_path / "eng").rglob("*")]:
        mode = stat.S_IMODE(os.stat(p).st_mode)
        assert mode & 0o044 == 0o044 and (not p.is_dir() or mode & 0o011 == 0o011), (p, oct(mode))


def test_a_preset_of_another_family_and_a_prompt_nothing_encodes_are_one_line(tmp_path):
    line = one_line_error(charbuild("--preset", "tiny-livetalk", "--out", tmp_path / "a"))
    assert "--preset tiny-livetalk is a livetalk model and target cpu-tiny serves the " \
        "characters family" in line, line
    r = subprocess.run(CHARBUILD + ["--target", "cpu-tiny-livetalk", "--prompt", "a guide",
                                    "--out", str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=300)
    line = one_line_error(r)
    assert "--prompt is encoded at build by --text-encoder DIR" in line, line
    assert tree(tmp_path) == []


@pytest.mark.parametrize("name", ["blocks.0.adaln.weight", "decoder", "patch_embed.bias"])
def test_every_non_finite_tensor_is_named(tmp_path, name):
    from charengine.characters.spec import PRESETS
    from charengine.characters.sidenets import check_side
    from charengine.characters.weights import check_state
    from charengine.checkpoint import CheckpointError

    spec = PRESETS["tiny"]
    with safe_open(str(TINY), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    key = next(k for k in state if k.startswith(name))
    state[key].view(-1)[0] = float("inf")
    side = {k: state.pop(k) for k in list(state) if k.split(".")[0] in
            ("audio_encoder", "decoder", "image_encoder", "text_encoder")}
    with pytest.raises(CheckpointError, match=rf"tensor '{key}' holds 1 non-finite value"):
        check_state(spec, state, "ckpt")
        check_side(spec, side, "ckpt")

"""What charrun does to its inputs, said and bounded: images are refused above and below
stated sizes before they are decoded, fitted by a selectable policy, transparency laid on a
stated background, and the largest accepted image stays within 500 MB; audio keeps its
declared length, NaN or infinite samples are refused, a truncated WAV is reported."""

import subprocess
import sys
import wave

import av
import numpy as np
import pytest
import torch
from PIL import Image

from charengine.runtime.formats import (AUDIO_FORMATS_SAID, MAX_IMAGE_PIXELS, ImageFit,
                                        MediaError)
from charengine.runtime.images import load_image
from charengine.runtime.media import read_audio

RATE = 16000


def test_an_image_over_the_pixel_bound_is_refused_before_it_is_decoded(tmp_path):
    big = tmp_path / "huge.png"  # 794 KB on disk, 768 MB as RGB
    Image.new("RGB", (16000, 16000), (90, 120, 200)).save(big)
    with pytest.raises(MediaError, match="megapixels"):  # from the header, before decoding
        load_image(big, 64, 64)
    side = int(MAX_IMAGE_PIXELS ** 0.5) + 1  # just over the bound, under Pillow's own
    Image.new("RGB", (side, side)).save(tmp_path / "over.png")
    with pytest.raises(MediaError, match=f"{side} x {side}"):
        load_image(tmp_path / "over.png", 64, 64)


# Peak resident memory from /proc (VmHWM is this program's own: getrusage's maxrss would
# carry the forking test process's peak across exec).
PEAK = """
import sys
from charengine.runtime.images import load_image

def kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

base = kb("VmRSS:")
pic = load_image(sys.argv[1], 64, 64)
print(kb("VmHWM:") - base, pic.describe())
"""


def test_the_largest_accepted_image_stays_within_500_mb(tmp_path):
    side = int(MAX_IMAGE_PIXELS ** 0.5)
    rgba = np.zeros((side, side, 4), np.uint8)
    rgba[..., 0] = np.arange(side, dtype=np.uint8)[None]
    rgba[..., 3] = 255
    rgba[:10, :10, 3] = 0
    Image.fromarray(rgba, "RGBA").save(tmp_path / "largest.png")
    del rgba
    r = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "largest.png")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    above, text = r.stdout.split(" ", 1)
    assert int(above) < 500e6, r.stdout
    assert f"{side} x {side} image fitted to 64 x 64" in text


def test_an_image_below_a_quarter_of_the_frame_is_refused(tmp_path):
    Image.new("RGB", (15, 200)).save(tmp_path / "thin.png")
    with pytest.raises(MediaError, match="at least 16 x 16"):
        load_image(tmp_path / "thin.png", 64, 64)
    Image.new("RGB", (16, 16)).save(tmp_path / "ok.png")
    assert load_image(tmp_path / "ok.png", 64, 64).pixels.shape == (3, 64, 64)


def test_fit_policies_do_what_they_say(tmp_path):
    # a wide image: left half red, right half blue, a green stripe in the middle
    a = np.zeros((100, 300, 3), np.uint8)
    a[:, :150, 0] = 255
    a[:, 150:, 2] = 255
    a[:, 140:160, :] = (0, 255, 0)
    Image.fromarray(a).save(tmp_path / "wide.png")
    cover = load_image(tmp_path / "wide.png", 64, 64, ImageFit("cover")).pixels
    contain = load_image(tmp_path / "wide.png", 64, 64, ImageFit("contain", "#000000")).pixels
    stretch = load_image(tmp_path / "wide.png", 64, 64, ImageFit("stretch")).pixels
    # cover keeps the middle third (the stripe is 20 of its 100 columns), scaled up
    assert cover[1, 32, 28:36].min() > 0.9 and cover[0, 32, 2] > 0.9 and cover[2, 32, 61] > 0.9
    # contain keeps it all inside, the margins the background (black)
    assert contain[:, :20].max() < 0.05 and contain[:, 44:].max() < 0.05
    assert contain[0, 32, 2] > 0.9 and contain[2, 32, 61] > 0.9
    # stretch keeps it all, squeezed: the stripe is narrower than in cover
    assert (stretch[1, 32] > 0.5).sum() < (cover[1, 32] > 0.5).sum()
    assert "by contain" in load_image(tmp_path / "wide.png", 64, 64,
                                      ImageFit("contain")).describe()


def test_transparent_pixels_are_laid_on_the_stated_background(tmp_path):
    a = np.zeros((64, 64, 4), np.uint8)
    a[..., 0] = 255  # red under the alpha everywhere; visible only in the middle
    a[16:48, 16:48, 3] = 255
    Image.fromarray(a, "RGBA").save(tmp_path / "cutout.png")
    pic = load_image(tmp_path / "cutout.png", 64, 64, ImageFit("cover", "#00ff00"))
    x = pic.pixels
    assert torch.allclose(x[:, 2, 2], torch.tensor([0.0, 1.0, 0.0]), atol=0.02)  # background
    assert torch.allclose(x[:, 32, 32], torch.tensor([1.0, 0.0, 0.0]), atol=0.02)  # the image
    assert pic.transparent and "on background #00ff00" in pic.describe()


def test_exif_orientation_turns_a_photo_upright(tmp_path):
    a = np.zeros((40, 80, 3), np.uint8)  # stored landscape, top row white
    a[:4] = 255
    im = Image.fromarray(a)
    exif = im.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to view"
    im.save(tmp_path / "phone.jpg", exif=exif.tobytes(), quality=95)
    pic = load_image(tmp_path / "phone.jpg", 64, 64, ImageFit("stretch"))
    assert pic.rotated and "upright" in pic.describe()
    assert pic.pixels[:, :, -6:].mean() > 0.8 and pic.pixels[:, :, :20].mean() < 0.1


def write_wav(path, x, rate=RATE):
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())


def write_audio(path, x, rate, codec, fmt):
    """Samples in [-1, 1] -> `path`'s container (by its suffix) in `codec`, given frames of
    sample format `fmt` (16-bit integers for "s16")."""
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=rate)
        s.layout = "mono"
        n = s.codec_context.frame_size or 1024
        for i in range(0, len(x), n):
            seg = (x[i:i + n] * 32767).astype(np.int16) if fmt == "s16" else \
                x[i:i + n].astype(np.float32)
            f = av.AudioFrame.from_ndarray(seg[None], format=fmt, layout="mono")
            f.sample_rate, f.pts = rate, i
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def tone(seconds, rate):
    t = np.arange(int(seconds * rate)) / rate
    return 0.3 * np.sin(2 * np.pi * 220 * t)


@pytest.mark.parametrize("rate", [24000, 44100])
def test_compressed_audio_keeps_its_length(tmp_path, rate):
    write_audio(tmp_path / "s.m4a", tone(3.0, rate), rate, "aac", "fltp")
    x = read_audio(tmp_path / "s.m4a", RATE)
    assert abs(x.numel() / RATE - 3.0) < 0.005, x.numel() / RATE


def test_audio_with_nan_or_infinite_samples_is_refused(tmp_path):
    x = tone(1.0, RATE).astype(np.float32)
    x[8000] = np.nan
    write_audio(tmp_path / "nan.wav", x, RATE, "pcm_f32le", "flt")
    with pytest.raises(MediaError, match=r"NaN or infinite samples \(the first at 0.5"):
        read_audio(tmp_path / "nan.wav", RATE)


def test_a_truncated_wav_is_read_and_reported(tmp_path):
    write_wav(tmp_path / "s.wav", tone(2.0, RATE))
    data = (tmp_path / "s.wav").read_bytes()
    (tmp_path / "cut.wav").write_bytes(data[: 44 + RATE * 2])  # the header says 2 s; 1 s left
    warnings = []
    x = read_audio(tmp_path / "cut.wav", RATE, warn=warnings.append)
    assert abs(x.numel() / RATE - 1.0) < 0.01
    assert len(warnings) == 1 and "declares 2.00 s and 1.00 s could be read" in warnings[0]
    warnings.clear()
    read_audio(tmp_path / "s.wav", RATE, warn=warnings.append)
    assert warnings == []


@pytest.mark.parametrize("kind", ["hls", "concat"])
def test_speech_that_is_a_playlist_naming_urls_opens_nothing_and_is_refused(kind):
    """An upload that is an HLS playlist or a concat list naming a URL and a local file (as
    FFmpeg's demuxers would follow them): no connection is made, no file is read, and the
    upload is refused in one line."""
    import socket
    import threading

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port, heard = listener.getsockname()[1], []
        listener.settimeout(0.2)

        def accept():
            try:
                heard.append(listener.accept()[0].recv(200))
            except OSError:
                pass

        url = f"http://127.0.0.1:{port}/speech.wav"
        body = {"hls": f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\n{url}\n"
                       "#EXTINF:10,\n/etc/hostname\n#EXT-X-ENDLIST\n",
                "concat": f"ffconcat version 1.0\nfile '{url}'\nfile '/etc/hostname'\n"}[kind]
        with pytest.raises(MediaError, match="not an audio file") as refused:
            read_audio(body.encode(), 16000)
        waiter = threading.Thread(target=accept)
        waiter.start()
        waiter.join()
    assert heard == [] and "\n" not in str(refused.value)


@pytest.mark.parametrize("fmt", ["EPS", "PPM", "PCX"])
def test_an_image_in_a_format_photos_do_not_come_in_is_refused_unread(tmp_path, fmt):
    """Pillow opens some forty formats; a reference image is read in the photo formats only
    (EPS would go to Ghostscript): any other is refused in one line that names them."""
    from charengine.runtime.formats import IMAGE_FORMATS

    path = tmp_path / f"face.{fmt.lower()}"
    Image.new("RGB", (64, 64), (200, 120, 90)).save(path, fmt)
    with pytest.raises(MediaError) as refused:
        load_image(path, 64, 64)
    said = str(refused.value)
    assert said.startswith(f"{path}: not an image in a format read here") and \
        all(f in said for f in IMAGE_FORMATS) and "\n" not in said, said


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "AVIF", "GIF", "BMP", "TIFF"])
def test_a_photo_in_each_format_read_is_read(fmt):
    import io

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 120, 90)).save(buf, fmt)
    pixels = load_image(buf.getvalue(), 64, 64).pixels
    assert pixels.shape == (3, 64, 64)
    assert (pixels.mean((1, 2)) * 255 - torch.tensor([200.0, 120.0, 90.0])).abs().max() < 8


@pytest.mark.parametrize("name,codec,rate,fmt", [
    ("s.wav", "pcm_s16le", 16000, "s16"), ("s.aiff", "pcm_s16be", 22050, "s16"),
    ("s.caf", "pcm_s16le", 16000, "s16"), ("s.mp3", "libmp3lame", 44100, "fltp"),
    ("s.aac", "aac", 24000, "fltp"), ("s.ogg", "libopus", 48000, "flt"),
    ("s.flac", "flac", 16000, "s16"), ("s.m4a", "aac", 44100, "fltp"),
    ("s.webm", "libopus", 48000, "flt"), ("s.mkv", "flac", 16000, "s16"),
    ("s.avi", "pcm_s16le", 16000, "s16"),
])
def test_speech_in_each_format_read_is_read(tmp_path, name, codec, rate, fmt):
    write_audio(tmp_path / name, tone(1.0, rate), rate, codec, fmt)
    x = read_audio((tmp_path / name).read_bytes(), RATE)
    assert abs(x.numel() / RATE - 1.0) < 0.1, x.numel() / RATE
    assert abs(float(x.square().mean().sqrt()) - 0.3 / 2 ** 0.5) < 0.03


@pytest.mark.parametrize("name,codec", [("s.au", "pcm_s16be"), ("s.voc", "pcm_s16le")])
def test_speech_in_a_container_outside_those_read_is_refused_unread(tmp_path, name, codec):
    """FFmpeg reads some three hundred containers; speech is read from the common audio
    ones alone (formats.AUDIO_DEMUXERS): another is refused in one line naming those."""
    write_audio(tmp_path / name, tone(1.0, 16000), 16000, codec, "s16")
    with pytest.raises(MediaError) as refused:
        read_audio(tmp_path / name, RATE)
    assert str(refused.value) == (f"{tmp_path / name}: not an audio file in a format read "
                                  f"here; give {AUDIO_FORMATS_SAID}")


def test_a_file_of_no_format_ffmpeg_knows_is_refused_with_its_words(tmp_path):
    (tmp_path / "notes.wav").write_text("a shopping list, not speech\n")
    with pytest.raises(MediaError) as refused:
        read_audio(tmp_path / "notes.wav", RATE)
    assert str(refused.value) == (
        f"{tmp_path / 'notes.wav'}: not an audio file in a format read here (Invalid data "
        f"found when processing input); give {AUDIO_FORMATS_SAID}")


def test_speech_in_a_codec_outside_those_read_is_refused_undecoded(tmp_path):
    """A WAV may carry any of FFmpeg's audio codecs; speech is decoded from the common ones
    alone (formats.AUDIO_CODECS): another is refused in one line naming its codec."""
    write_audio(tmp_path / "adpcm.wav", tone(1.0, 16000), 16000, "adpcm_ms", "s16")
    with pytest.raises(MediaError) as refused:
        read_audio(tmp_path / "adpcm.wav", RATE)
    said = str(refused.value)
    assert said == (f"{tmp_path / 'adpcm.wav'}: holds speech in the adpcm_ms codec, which is "
                    "not read here; give PCM, MP3, AAC, Opus, Vorbis, FLAC or ALAC"), said


def test_the_speech_of_a_video_clip_is_read(tmp_path):
    """An MP4 with H.264 video and AAC speech (a recorded clip): its speech is read, its
    video not decoded."""
    path = tmp_path / "clip.mp4"
    x = tone(1.0, RATE).astype(np.float32)
    with av.open(str(path), "w") as c:
        v = c.add_stream("libx264", rate=24)
        v.width, v.height, v.pix_fmt = 64, 64, "yuv420p"
        a = c.add_stream("aac", rate=RATE)
        a.layout = "mono"
        for k in range(24):
            frame = av.VideoFrame.from_ndarray(np.zeros((64, 64, 3), np.uint8), format="rgb24")
            frame.pts = k
            for p in v.encode(frame):
                c.mux(p)
        for i in range(0, RATE, 1024):
            f = av.AudioFrame.from_ndarray(x[None, i:i + 1024].copy(), format="fltp",
                                           layout="mono")
            f.sample_rate, f.pts = RATE, i
            for p in a.encode(f):
                c.mux(p)
        for stream in (v, a):
            for p in stream.encode():
                c.mux(p)
    speech = read_audio(path, RATE)
    assert abs(speech.numel() / RATE - 1.0) < 0.1
    assert abs(float(speech.square().mean().sqrt()) - 0.3 / 2 ** 0.5) < 0.03

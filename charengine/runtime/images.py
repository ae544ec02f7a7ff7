"""Reference images through Pillow: the size read from the header and bounded before any
pixel is decoded, JPEGs decoded at a reduced scale, EXIF orientation applied, transparency
laid on a stated background, and the image fitted to the model's frame by a stated policy."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .formats import (EXIF_ORIENTATION, FIT_POLICIES, IMAGE_FORMATS, MAX_IMAGE_PIXELS,
                      MIN_IMAGE_FRACTION, ImageFit, MediaError, parse_colour, source_of)


@dataclass
class Picture:
    """A reference image read for the model: pixels [3, H, W] in [0, 1] and what was done."""
    pixels: torch.Tensor
    source_size: tuple[int, int]  # (width, height) as stored, before any rotation
    fit: ImageFit
    transparent: bool  # some pixels were transparent and were laid on the background
    rotated: bool  # turned upright from the EXIF orientation

    def describe(self) -> str:
        (w, h), (H, W) = self.source_size, self.pixels.shape[1:]
        out = (f"{w} x {h} image fitted to {W} x {H} by {self.fit.policy} "
               f"({FIT_POLICIES[self.fit.policy]})")
        if self.rotated:
            out += ", turned upright from its EXIF orientation"
        if self.transparent or self.fit.policy == "contain":
            out += f", on background {self.fit.background}"
        return out


def load_image(src: str | Path | bytes, height: int, width: int,
               fit: ImageFit = ImageFit()) -> Picture:
    """An image file (a path or its bytes) -> the model's frame, without decoding more
    than it needs: the size is read from the header and refused outside the stated bounds
    before any pixel is decoded, JPEGs decode at a reduced scale where that still covers
    the frame, and large images are box-reduced before any conversion."""
    import warnings

    from PIL import Image, ImageOps, UnidentifiedImageError

    T = Image.Transpose  # EXIF orientation 2-8 -> the transposition that makes it upright
    EXIF_TRANSPOSE = {2: T.FLIP_LEFT_RIGHT, 3: T.ROTATE_180, 4: T.FLIP_TOP_BOTTOM,
                      5: T.TRANSPOSE, 6: T.ROTATE_270, 7: T.TRANSVERSE, 8: T.ROTATE_90}
    f, path = source_of(src)
    bg = parse_colour(fit.background)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(f, formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as e:
        raise MediaError(f"{path}: the image is over {MAX_IMAGE_PIXELS // 1_000_000} "
                         f"megapixels ({e}); scale it down first") from None
    except (UnidentifiedImageError, OSError) as e:
        raise MediaError(f"{path}: not an image in a format read here ({e}); give a "
                         f"{', '.join(IMAGE_FORMATS[:-1])} or {IMAGE_FORMATS[-1]} file") from None
    with im:
        w, h = im.size
        if w * h > MAX_IMAGE_PIXELS:
            raise MediaError(f"{path}: the image is {w} x {h} ({w * h / 1e6:.0f} megapixels); "
                             f"images up to {MAX_IMAGE_PIXELS // 1_000_000} megapixels are read: "
                             "scale it down first")
        try:
            orientation = im.getexif().get(EXIF_ORIENTATION, 1)
        except (OSError, ValueError, SyntaxError):
            orientation = 1  # an unreadable EXIF block: the image as stored
        quarter = orientation in (5, 6, 7, 8)  # stored a quarter turn from upright
        uw, uh = (h, w) if quarter else (w, h)
        min_w, min_h = round(width * MIN_IMAGE_FRACTION), round(height * MIN_IMAGE_FRACTION)
        if uw < min_w or uh < min_h:
            raise MediaError(f"{path}: the image is {uw} x {uh}; this model needs at least "
                             f"{min_w} x {min_h} (a quarter of its {width} x {height} frame)")
        # the smallest size the fit needs, upright, then on the image's stored axes
        if fit.policy == "stretch":
            need = (width, height)
        else:
            s = (max if fit.policy == "cover" else min)(height / uh, width / uw)
            need = (max(1, math.ceil(uw * s)), max(1, math.ceil(uh * s)))
        if quarter:
            need = need[::-1]
        try:
            if im.format == "JPEG":
                im.draft("RGB", need)  # the decoder's own DCT scaling
            alpha = im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info
            if im.mode not in ("RGB", "RGBA"):
                im = im.convert("RGBA" if alpha else "RGB")
            else:
                im.load()
            transparent = im.mode == "RGBA" and im.getchannel("A").getextrema()[0] < 255
            k = max(1, min(im.size[0] // (2 * need[0]), im.size[1] // (2 * need[1])))
            small = im.reduce(k) if k > 1 else im.copy()
            del im
        except (OSError, ValueError, SyntaxError) as e:
            raise MediaError(f"{path}: the image could not be decoded ({e})") from None
    rotated = orientation in EXIF_TRANSPOSE
    if rotated:
        small = small.transpose(EXIF_TRANSPOSE[orientation])
    if small.mode == "RGBA":
        small = Image.alpha_composite(Image.new("RGBA", small.size, (*bg, 255)), small)
    rgb = small.convert("RGB")
    size = (width, height)
    if fit.policy == "cover":
        rgb = ImageOps.fit(rgb, size, method=Image.Resampling.LANCZOS)
    elif fit.policy == "contain":
        rgb = ImageOps.pad(rgb, size, method=Image.Resampling.LANCZOS, color=bg)
    else:
        rgb = rgb.resize(size, Image.Resampling.LANCZOS)
    x = torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255
    return Picture(x, (w, h), fit, transparent, rotated)


def read_image(src: str | Path | bytes, height: int, width: int,
               fit: ImageFit = ImageFit()) -> torch.Tensor:
    """An image file (a path or its bytes) -> [3, height, width] in [0, 1] (load_image's
    pixels; by default scaled to cover, then centre-cropped)."""
    return load_image(src, height, width, fit).pixels

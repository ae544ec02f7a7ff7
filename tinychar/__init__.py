"""The tiny character's training and evaluation, outside the serving package: procedural
talking-character clips (`synth`), the full-sequence training forward that equals the
engine's steps (`sequence`), offline animation of a speech file through the engine's step
(`offline`), and the quality measures (`quality`: lip sync, PSNR / SSIM, bootstrap).
scripts/train_tiny.py trains with them, scripts/eval_quality.py and scripts/quality.py score
with them; charengine imports none of them."""

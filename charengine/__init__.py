"""charengine: real-time serving of an autoregressive video diffusion transformer."""

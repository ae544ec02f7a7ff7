"""charbuild: shard, quantize, bake and write per-rank engines."""

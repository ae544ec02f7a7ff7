import torch

from charengine.characters.cache import KVCache
from charengine.config import preset
from charengine.characters.config import Switches


def test_ring_reread_in_slot_order_permutes_temporal_positions():
    """What ring_cache without rope_at_write would do: the baseline's read assigns positions
    by slot order, but ring slots stop being chronological once the ring wraps."""
    cfg = preset("tiny", switches=Switches(fp8_kv=False))
    cache = KVCache(cfg, heads=1)
    W = cfg.cache.window
    written_at = {}
    for k in range(3 * W + 2):
        written_at[int(cache.write_frame())] = k
        if k >= W - 1:
            true = torch.tensor([cfg.cache.first_temporal_index + k % cfg.cache.reset_period
                                 - (k - written_at[i]) for i in range(W)])
            slot_order = cache.slot_order_temporal()
            assert sorted(true.tolist()) == sorted(slot_order.tolist())  # a permutation...
            if (k + 1) % W:
                assert not torch.equal(true, slot_order)  # ...that is wrong after a wrap
        cache.end_step()


def test_ring_write_position_and_temporal_index_live_on_device():
    cfg = preset("tiny")
    cache = KVCache(cfg, heads=1)
    seen = []
    for _ in range(50):
        seen.append((int(cache.write_frame()), int(cache.temporal_index())))
        cache.end_step()
    assert [s for s, _ in seen[:8]] == [0, 1, 2, 3, 4, 5, 0, 1]
    assert seen[0][1] == 7 and seen[41][1] == 48 and seen[42][1] == 7

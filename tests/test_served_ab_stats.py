"""The served A/B harness's statistics (tests/gpu/served_ab.py), checked on CPU."""

import random

from tests.gpu.served_ab import interval


def test_bootstrap_interval_holds_the_median_and_narrows_with_less_noise():
    rng = random.Random(1)
    noisy = [1.0 + rng.gauss(0, 0.2) for _ in range(5)]
    quiet = [1.0 + rng.gauss(0, 0.01) for _ in range(5)]
    med, lo, hi = interval(noisy)
    assert lo <= med <= hi and med == sorted(noisy)[2]
    q_med, q_lo, q_hi = interval(quiet)
    assert q_lo <= q_med <= q_hi
    assert q_hi - q_lo < hi - lo
    assert interval([0.9, 1.1])[0] == 1.0  # an even count: the middle two averaged

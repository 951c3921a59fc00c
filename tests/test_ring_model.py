"""benchmarks/ring_model.py: the cost model sync_cost.py validates and projection.py uses.

The fit is checked on times the model itself generates (so the answer is known),
with noise, and on what it must refuse to invent.
"""

import math
import sys

import numpy as np
import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from ring_model import RingModel, fit_ring_model, pack_is_copied, predict  # noqa: E402

MB = 2**20
TRUE = RingModel(bandwidth_small=2.0e9, bandwidth_large=1.2e9, switch_bytes=40 * MB,
                 latency=500e-6, pack_bandwidth=8e9, per_tensor=60e-6)
SINGLES_MB = (1 / 32, 1 / 4, 1, 2, 4, 8, 24, 32, 48, 64, 96, 128)


def calibration(model, strategy="horovod", noise=0.0, seed=0):
    """sync_cost.py's calibration runs, timed by `model` (with relative noise)."""
    rng = np.random.default_rng(seed)
    lists = [[int(mb * MB) // 4] for mb in SINGLES_MB]
    lists += [[int(mb * MB) // 16] * 4 + [10] for mb in (2, 8, 32, 64)]
    lists += [[1024] * count for count in (16, 64)]
    runs = []
    for elements in lists:
        seconds = predict(model, strategy, elements) * (1 + noise * rng.standard_normal())
        runs.append((4.0 * sum(elements), len(elements), pack_is_copied(strategy, elements),
                     seconds))
    return runs


def test_the_fit_recovers_the_constants_that_made_the_times():
    fitted = fit_ring_model(calibration(TRUE))
    for field in ("bandwidth_small", "bandwidth_large", "latency", "pack_bandwidth",
                  "per_tensor"):
        assert getattr(fitted, field) == pytest.approx(getattr(TRUE, field), rel=1e-6), field
    assert 32 * MB < fitted.switch_bytes <= 48 * MB  # between the sizes either side of it


@pytest.mark.parametrize("seed", range(5))
def test_with_5_percent_noise_it_predicts_unseen_gradients_within_10_percent(seed):
    fitted = fit_ring_model(calibration(TRUE, noise=0.05, seed=seed))
    mlp_100mb = [4096 * 4096, 4096, 4096 * 2048, 2048, 2048 * 1024, 1024, 1024 * 10, 10]
    mlp_10mb = [1024 * 1024, 1024, 1024 * 1024, 1024, 1024 * 512, 512, 512 * 10, 10]
    for elements in (mlp_100mb, mlp_10mb, [100 * 128, 128, 128 * 64, 64, 64 * 10, 10]):
        assert predict(fitted, "horovod", elements) == pytest.approx(
            predict(TRUE, "horovod", elements), rel=0.10)


def test_one_bandwidth_is_not_split_into_two_and_an_unused_term_is_zero():
    flat = RingModel(bandwidth_small=3e9, bandwidth_large=3e9, switch_bytes=math.inf,
                     latency=300e-6, pack_bandwidth=math.inf, per_tensor=0.0)
    fitted = fit_ring_model(calibration(flat, strategy="multi_worker"))
    assert fitted.bandwidth_small == pytest.approx(3e9, rel=1e-3)
    assert fitted.bandwidth_large == pytest.approx(3e9, rel=1e-3)
    assert fitted.pack_bandwidth == math.inf and fitted.per_tensor == pytest.approx(0, abs=1e-9)


def test_a_bandwidth_that_rises_is_latency_and_is_not_fitted_as_a_switch():
    # Small messages slower per byte than large ones: a fixed cost, not a second link.
    rising = RingModel(bandwidth_small=0.1e9, bandwidth_large=2e9, switch_bytes=0.1 * MB,
                       latency=400e-6, pack_bandwidth=math.inf, per_tensor=0.0)
    fitted = fit_ring_model(calibration(rising, strategy="mirrored"))
    assert fitted.bandwidth_small >= fitted.bandwidth_large


def test_the_ring_term_grows_as_2_n_minus_1_over_n():
    link = RingModel(bandwidth_small=1e9, bandwidth_large=1e9, switch_bytes=math.inf,
                     latency=0.0, pack_bandwidth=math.inf, per_tensor=0.0)
    assert link.seconds(1e9, replicas=2) == pytest.approx(1.0)
    assert link.seconds(1e9, replicas=128) == pytest.approx(2 * 127 / 128)


def test_which_lists_are_copied_out_of_their_pack():
    assert not pack_is_copied("horovod", [1 << 20])  # one tensor: reduced in place
    assert pack_is_copied("horovod", [16, 16])  # the fusion buffer: always
    # TensorFlow's split shares the pack only when every piece is a multiple of 64 bytes.
    assert not pack_is_copied("multi_worker", [1 << 20, 1024, 16])
    assert pack_is_copied("multi_worker", [1 << 20, 1024, 10])
    assert pack_is_copied("mirrored", [8, 1 << 20])

"""The auto ping-pong decision: alternate both modes per round shape, keep the faster by median,
measure again after a while."""

import pytest

from moemesh.engine.runner.overlap_tuner import OverlapTuner, round_shape


def test_shapes_bucket_tokens_by_powers_of_two_and_tell_decode_from_mixed_rounds():
    assert round_shape(32, True) == round_shape(17, True) == (True, 5)
    assert round_shape(33, True) == (True, 6) and round_shape(32, False) == (False, 5)
    assert round_shape(1, True) == (True, 0)


def test_it_alternates_from_overlapped_then_keeps_the_faster_median():
    tuner = OverlapTuner(num_trials=3, reprobe_every=100)
    shape = (True, 5)
    seconds = {True: [0.010, 0.050, 0.011], False: [0.012, 0.013, 0.001]}  # one outlier each way
    modes = []
    for _ in range(6):
        assert tuner.measuring(shape) or not modes
        mode = tuner.use_overlap(shape)
        modes.append(mode)
        tuner.record(shape, mode, seconds[mode].pop(0))
    assert modes == [True, False, True, False, True, False]
    assert not tuner.measuring(shape)
    assert [tuner.use_overlap(shape) for _ in range(3)] == [True] * 3  # median 11 ms < 12 ms
    assert tuner.chosen() == {shape: True}
    other = (True, 3)  # every shape is measured on its own
    assert tuner.use_overlap(other) and tuner.measuring(other)


def test_it_measures_again_after_reprobe_every_rounds_of_a_shape():
    tuner = OverlapTuner(num_trials=1, reprobe_every=5)
    shape = (False, 7)
    for seconds in (0.02, 0.01):  # overlapped slower
        tuner.record(shape, tuner.use_overlap(shape), seconds)
    assert [tuner.use_overlap(shape) for _ in range(3)] == [False] * 3
    assert tuner.use_overlap(shape) is True and tuner.measuring(shape)  # round 6: a new measurement
    with pytest.raises(ValueError):
        OverlapTuner(num_trials=3, reprobe_every=6)

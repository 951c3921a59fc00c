"""PreemptionWatch and the one-process stop agreements, with real signals."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tfdist.resume.preemption import RESTART_EXIT_CODE, LocalStop, PreemptionWatch, VotedStop


def test_sigterm_is_recorded_not_fatal_and_given_back_after():
    received = []
    previous = signal.signal(signal.SIGTERM, lambda *_: received.append("previous"))
    try:
        watch = PreemptionWatch(grace_seconds=60)
        assert watch.install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.signalled and received == []
        # Unanswered when training ends: the previous handler gets it.
        watch.uninstall()
        assert received == ["previous"]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_no_signal_leaves_the_previous_handler_untouched():
    received = []
    previous = signal.signal(signal.SIGTERM, lambda *_: received.append("previous"))
    try:
        watch = PreemptionWatch(grace_seconds=60)
        watch.install()
        watch.uninstall()
        assert not watch.signalled and received == []
        assert signal.getsignal(signal.SIGTERM) is not watch._on_signal
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.serial
@pytest.mark.multiprocess
def test_a_process_that_does_not_stop_in_time_exits_with_the_restart_code():
    code = ("import os, signal, time; from tfdist.resume.preemption import PreemptionWatch; "
            "w = PreemptionWatch(grace_seconds=1); w.install(); "
            "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=20)
    assert result.returncode == RESTART_EXIT_CODE
    assert time.monotonic() - started < 15
    assert "no step boundary was reached within checkpoint.grace_seconds=1" in result.stderr


def test_off_the_main_thread_it_does_not_install():
    import threading

    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(PreemptionWatch(5).install()))
    thread.start()
    thread.join()
    assert outcome == [False]


def test_local_and_voted_agreements():
    import tensorflow as tf

    assert LocalStop().should_stop(1, True) and not LocalStop().should_stop(1, False)
    flag, votes = tf.Variable(0.0), tf.Variable(0.0)
    agreement = VotedStop(flag, votes)
    agreement.start()
    assert not agreement.should_stop(1, True) and float(flag.numpy()) == 1.0
    votes.assign(flag + 0.0)  # what the next update's allreduce writes: 1 rank of 2 raised
    assert agreement.should_stop(2, False)

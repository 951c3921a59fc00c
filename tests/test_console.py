"""Several tasks' output on one console: whole lines prefixed, a progress bar's `\\r`
updates kept to one updating line per task, whatever the chunks the pipe delivers."""

import io

import pytest

from tfdist.app.console import Console
from tfdist.quiet import is_tensorflow_log_line

# What Keras's progress bar writes to a pipe for one epoch of 3 steps (it redraws with
# backspaces and "\r", and ends the epoch's line with "\n"), then a whole line.
KERAS_EPOCH = ("Epoch 1/1\n" + "\r1/3 [=>....] - ETA: 1s" + "\b" * 22 + "\r2/3 [===>..] - ETA: 0s"
               + "\b" * 22 + "\r3/3 [======] - 1s 5ms/step\n" + "done\n")


def rendered(text):
    """What a terminal shows: each line as its last rewrite after "\\r"."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")][:-1]


def feed_in_chunks(console, task, text, size):
    stream = console.stream(task)
    for start in range(0, len(text), size):
        stream.feed(text[start:start + size])
    stream.close()


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(KERAS_EPOCH)])
def test_a_progress_bar_is_one_updating_line_whatever_the_chunks(size):
    output = io.StringIO()
    feed_in_chunks(Console(output), "worker:0", KERAS_EPOCH, size)
    assert rendered(output.getvalue()) == ["[worker:0] Epoch 1/1",
                                           "[worker:0] 3/3 [======] - 1s 5ms/step",
                                           "[worker:0] done"]
    assert "\b" not in output.getvalue()


def test_another_tasks_line_goes_below_an_updating_line():
    output = io.StringIO()
    console = Console(output)
    chief, other = console.stream("worker:0"), console.stream("worker:1")
    chief.feed("\r1/3 [=>....]")
    other.feed("a line of worker 1\n")
    chief.feed("\r2/3 [===>..]")
    chief.feed("\r3/3 [======]\n")
    assert rendered(output.getvalue()) == ["[worker:0] 1/3 [=>....]",
                                           "[worker:1] a line of worker 1",
                                           "[worker:0] 3/3 [======]"]


def test_a_carriage_return_and_newline_split_across_chunks_ends_the_line():
    output = io.StringIO()
    stream = Console(output).stream("worker:0")
    stream.feed("a windows line\r")
    stream.feed("\nnext")
    stream.close()
    assert rendered(output.getvalue()) == ["[worker:0] a windows line", "[worker:0] next"]


def test_the_launchers_own_lines_and_the_log_filter():
    output = io.StringIO()
    console = Console(output, keep_line=lambda line: not is_tensorflow_log_line(line))
    stream = console.stream("worker:0")
    stream.feed("I0000 00:00:1795379617.205788     700 port.cc:153] oneDNN custom operations\n")
    stream.feed("\r1/3")
    console.say("tfdist launch: worker:1 exited with status 1; stopping the other tasks")
    assert rendered(output.getvalue()) == [
        "[worker:0] 1/3", "tfdist launch: worker:1 exited with status 1; stopping the other tasks"]


def test_an_ordinary_line_read_in_pieces_is_written_once_whole():
    output = io.StringIO()
    feed_in_chunks(Console(output), "worker:0", "a line that arrives in pieces\nand another\n", 4)
    assert output.getvalue() == ("[worker:0] a line that arrives in pieces\n"
                                 "[worker:0] and another\n")

"""tfdist launch with real processes: topology, output, failure, restarts, Ctrl-C, no orphans."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import TFDIST, run_command


def is_running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command_line = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in command_line and is_running(int(entry.name)):
            found.append(int(entry.name))
    return found


def python(code: str, marker: str) -> list[str]:
    """A child command: Python running `code`, with `marker` on its command line."""
    return [sys.executable, "-c", code, marker]


REPORT = """
import json, os, sys
config = json.loads(os.environ["TF_CONFIG"])
print(json.dumps({"task": config["task"], "cluster": config["cluster"],
                  "passed": os.environ.get("TFDIST_TEST_PASSTHROUGH")}))
"""


@pytest.mark.multiprocess
def test_each_worker_gets_its_tf_config_and_the_environment(tmp_path):
    marker = uuid.uuid4().hex
    result = run_command([TFDIST, "launch", "-n", "3", "--", *python(REPORT, marker)],
                         cwd=tmp_path, env={"TFDIST_TEST_PASSTHROUGH": "yes"})
    assert result.returncode == 0, result.stdout
    reports = {}
    for line in result.stdout.splitlines():
        prefix, _, text = line.partition("] ")
        reports[prefix.lstrip("[")] = json.loads(text)
    assert set(reports) == {"worker:0", "worker:1", "worker:2"}
    addresses = reports["worker:0"]["cluster"]["worker"]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    for name, report in reports.items():
        assert report["task"] == {"type": "worker", "index": int(name.split(":")[1])}
        assert report["cluster"] == {"worker": addresses}
        assert report["passed"] == "yes"


FAIL_ONE = """
import json, os, subprocess, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
if index == 1:
    time.sleep(1)
    sys.exit(3)
subprocess.Popen(["sleep", "300", sys.argv[1]])   # a grandchild
time.sleep(300)
"""


@pytest.mark.serial
@pytest.mark.multiprocess
def test_a_failing_worker_stops_the_group_fast_and_leaves_no_orphans(tmp_path):
    marker = uuid.uuid4().hex
    started = time.monotonic()
    result = run_command([TFDIST, "launch", "-n", "2", "--", *python(FAIL_ONE, marker)],
                         cwd=tmp_path, timeout=60)
    elapsed = time.monotonic() - started
    assert result.returncode == 3
    assert "worker:1 exited with status 3" in result.stdout
    assert elapsed < 10, elapsed
    assert processes_with(marker) == []


SERVE_UNTIL_STOPPED = """
import json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
print(task["type"], task["index"], flush=True)
if task["type"] == "chief":
    time.sleep(1)
    sys.exit(0)
time.sleep(300)
"""


@pytest.mark.multiprocess
def test_with_parameter_servers_the_chief_decides_and_servers_are_stopped(tmp_path):
    marker = uuid.uuid4().hex
    result = run_command([TFDIST, "launch", "-n", "2", "--ps", "1", "--",
                          *python(SERVE_UNTIL_STOPPED, marker)], cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stdout
    for line in ("[chief:0] chief 0", "[worker:0] worker 0", "[worker:1] worker 1", "[ps:0] ps 0"):
        assert line in result.stdout
    assert processes_with(marker) == []


FAIL_FIRST_TIME = """
import json, os, sys
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
flag = os.path.join(os.getcwd(), f"ran-{index}")
if not os.path.exists(flag):
    open(flag, "w").close()
    sys.exit(1 if index == 0 else 0)
print("second run")
"""


@pytest.mark.multiprocess
def test_max_restarts_restarts_the_whole_group(tmp_path):
    marker = uuid.uuid4().hex
    result = run_command([TFDIST, "launch", "-n", "2", "--max_restarts", "1", "--",
                          *python(FAIL_FIRST_TIME, marker)], cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stdout
    assert "restarting the group (restart 1 of 1)" in result.stdout
    assert "[worker:0] second run" in result.stdout


@pytest.mark.multiprocess
def test_without_restarts_a_failure_is_final(tmp_path):
    result = run_command([TFDIST, "launch", "-n", "2", "--",
                          *python(FAIL_FIRST_TIME, uuid.uuid4().hex)], cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    assert "worker:0 exited with status 1" in result.stdout


# Each child says it is up in a file of its own (its pid in the name): a process's command
# line reads empty for a moment while it execs, so counting children by command line can
# miss one that is starting.
SLEEP = """
import os, pathlib, time
pathlib.Path(f"up.{os.getpid()}").touch()
time.sleep(300)
"""


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("signum, started_ignoring_sigint", [
    (signal.SIGINT, False), (signal.SIGTERM, False),
    # As a background job of a non-interactive shell starts it (CI, nohup scripts).
    (signal.SIGINT, True)])
@pytest.mark.multiprocess
def test_interrupting_the_launcher_stops_every_child(signum, started_ignoring_sigint, tmp_path):
    marker = uuid.uuid4().hex
    launcher = subprocess.Popen([TFDIST, "launch", "-n", "2", "--", *python(SLEEP, marker)],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True,
                                preexec_fn=_ignore_sigint if started_ignoring_sigint else None)

    def children():
        return [int(path.suffix[1:]) for path in tmp_path.glob("up.*")]

    deadline = time.monotonic() + 120  # a hang bound, not a timing
    while len(children()) < 2 and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.1)
    assert len(children()) == 2, launcher.poll()
    launcher.send_signal(signum)
    output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signum, output  # 130 after Ctrl-C, 143 after SIGTERM
    assert "interrupted; stopping every task" in output
    assert not any(is_running(pid) for pid in children())
    assert processes_with(marker) == []


@pytest.mark.parametrize("args, fragment", [
    (["launch", "-n", "0", "--", "true"], "-n must be an integer >= 1"),
    (["launch", "-n", "2"], "needs a command after '--'"),
    (["launch", "-n", "two", "--", "true"], "flag --num_workers=two"),
    (["launch", "--ps", "-1", "-n", "1", "--", "true"], "--ps must be an integer >= 0"),
    (["launch", "-n", "1", "stray", "--", "true"], "unexpected: stray"),
    (["launch", "-n", "2", "--", "nosuchcmd"], "tfdist launch: command not found: nosuchcmd; "
                                               "give a program on PATH or a path to an "
                                               "executable file"),
    (["supervise"], "tfdist supervise needs a command after '--'"),
    (["supervise", "--", "nosuchcmd"], "tfdist supervise: command not found: nosuchcmd"),
    (["supervise", "--grace_seconds", "0", "--", "true"],
     "tfdist supervise --grace_seconds must be > 0"),
])
@pytest.mark.multiprocess
@pytest.mark.refuses
def test_bad_input(args, fragment, tmp_path):
    result = run_command([TFDIST, *args], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert fragment in result.stderr


WORKER_1_FAILS = """
import json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
if task["type"] == "worker" and task["index"] == 1:
    sys.exit(3)
if task["type"] == "chief":
    time.sleep(3)
    print("chief finished", flush=True)
    sys.exit(0)
time.sleep(300)
"""


@pytest.mark.multiprocess
def test_with_parameter_servers_a_worker_failure_is_left_to_the_chief(tmp_path):
    marker = uuid.uuid4().hex
    result = run_command([TFDIST, "launch", "-n", "2", "--ps", "1", "--",
                          *python(WORKER_1_FAILS, marker)], cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stdout
    assert "worker:1 exited with status 3; the chief decides whether training goes on" \
        in result.stdout
    assert "[chief:0] chief finished" in result.stdout
    assert processes_with(marker) == []


SAVES_THEN_EXITS_143 = """
import json, os, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
if index == 1:
    time.sleep(2)   # still saving when worker 0 is done
    open(os.path.join(os.getcwd(), "saved-1"), "w").close()
sys.exit(143)
"""


@pytest.mark.multiprocess
def test_a_task_exiting_143_gives_the_others_time_to_save(tmp_path):
    result = run_command([TFDIST, "launch", "-n", "2", "--", *python(SAVES_THEN_EXITS_143,
                                                                     uuid.uuid4().hex)],
                         cwd=tmp_path, timeout=60)
    assert result.returncode == 143
    assert "worker:0 exited with status 143 (saved for a restart)" in result.stdout
    assert (tmp_path / "saved-1").exists()  # worker 1 was not stopped in its save


KILLED = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"


@pytest.mark.multiprocess
def test_a_task_killed_by_a_signal_ends_the_group_with_128_plus_the_signal(tmp_path):
    result = run_command([TFDIST, "launch", "-n", "1", "--", *python(KILLED, "x")],
                         cwd=tmp_path, timeout=60)
    assert result.returncode == 137
    assert "worker:0 exited with status 137" in result.stdout


@pytest.mark.multiprocess
@pytest.mark.refuses
def test_a_bad_grace_period_is_one_line(tmp_path):
    result = run_command([TFDIST, "launch", "-n", "1", "--grace_seconds", "0", "--", "true"],
                         cwd=tmp_path)
    assert result.returncode == 2
    assert "--grace_seconds must be > 0" in result.stderr


TENSORFLOW_LINES = '''
import sys
print("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR")
print("I0000 00:00:1795379615.512060    9690 port.cc:153] oneDNN custom operations are on.")
print("W0000 00:00:1795379617.205788     700 auto_shard.cc:559] The `assert_cardinality`")
print("E0000 00:00:1795379617.205788     700 grpc_server.cc:12] a real error")
print("the user's own line")
'''


@pytest.mark.parametrize("verbose", [False, True])
@pytest.mark.multiprocess
def test_tensorflow_start_up_lines_are_hidden_unless_verbose(tmp_path, verbose):
    result = run_command([TFDIST, "launch", *(["--verbose"] if verbose else []), "-n", "1",
                          "--", sys.executable, "-c", TENSORFLOW_LINES], cwd=tmp_path,
                         env={"TF_CPP_MIN_LOG_LEVEL": None})
    assert result.returncode == 0, result.stdout
    lines = [line.removeprefix("[worker:0] ") for line in result.stdout.splitlines()
             if line.startswith("[worker:0] ")]
    shown = TENSORFLOW_LINES.count("print(") if verbose else 2  # errors are always shown
    assert len(lines) == shown, lines
    assert lines[-2:] == ["E0000 00:00:1795379617.205788     700 grpc_server.cc:12] a real "
                          "error", "the user's own line"]


@pytest.mark.multiprocess
def test_a_log_level_the_user_set_is_left_alone(tmp_path):
    result = run_command([TFDIST, "launch", "-n", "1", "--", sys.executable, "-c",
                          "import os; print('level', os.environ['TF_CPP_MIN_LOG_LEVEL'])\n"
                          + TENSORFLOW_LINES], cwd=tmp_path, env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert "[worker:0] level 0" in result.stdout
    assert "port.cc:153] oneDNN" in result.stdout


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    # A port from bind(0) lies in the ephemeral range, where any process's outgoing
    # connection (a gRPC channel of a cluster beside this one) can take it before the
    # task binds it: a parameter server then failed with "Could not start gRPC server".
    import socket

    from tfdist.app.launch import free_ports
    from tfdist.cluster import ephemeral_port_range

    low, _ = ephemeral_port_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(20000 <= port < low for port in ports), (ports, low)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_held_port_is_skipped_by_another_launcher_yet_a_server_can_listen_on_it():
    # Between the pick and the task's bind, another launcher's random draw could land on
    # the same port: a parameter server then failed with "Could not start gRPC server"
    # in a full run. The launcher now holds its ports until the tasks bind them.
    import socket

    from tfdist.app.launch import free_ports, reserved_ports

    with reserved_ports(3) as held:
        with socket.socket() as other:   # another launcher's pick: a plain bind
            for port in held:
                with pytest.raises(OSError):
                    other.bind(("127.0.0.1", port))
        assert not set(held) & set(free_ports(200))
        for port in held:   # the task's server binds as gRPC does: SO_REUSEADDR, on all addresses
            with socket.socket() as server:
                server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                server.bind(("0.0.0.0", port))
                server.listen()

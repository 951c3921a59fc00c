"""A one-machine run is reachable from nowhere else: `tfdist launch`'s private network, and the
docs' one-machine `mpirun` command (`tfdist isolate`), run as the Clusters page writes it.

Each launch is probed while its servers are up: every port each of its processes listens
on (read from /proc: the process's own sockets) is tried on each of this machine's
non-loopback addresses. The connections stay on this machine (its own addresses).
"""

import ast
import fcntl
import io
import json
import os
import shlex
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TFDIST, run_command
from tfdist.app import isolation, launch

pytestmark = pytest.mark.multiprocess

SCRIPT = str(REPO / "tests" / "scripts" / "listening_task.py")
SIOCGIFADDR = 0x8915
LAUNCH_BOUND_SECONDS = 240  # a hang bound: a tiny model, one epoch


def machine_addresses():
    """This machine's IPv4 addresses beyond loopback, one per interface that has one."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            if name == "lo":
                continue
            try:
                answer = fcntl.ioctl(sock, SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            found.append(socket.inet_ntoa(answer[20:24]))
    return found


def listening_ports(pid):
    """The TCP ports process `pid` listens on (its own sockets, IPv4 and IPv6)."""
    proc = Path(f"/proc/{pid}")
    inodes = socket_inodes(pid)
    ports = set()
    for table in ("tcp", "tcp6"):
        for row in (proc / "net" / table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, and this process's
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def socket_inodes(pid):
    """The inodes of process `pid`'s sockets."""
    inodes = set()
    for descriptor in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = descriptor.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def reached(pids, address, port):
    """Whether a connection to `address`:`port` is accepted, by a socket of one of `pids`.

    The connection is accepted by a listener in this machine's network (the one this
    test runs in); it counts only when that listener is one of `pids`' sockets. Another
    process on the machine (another test's ranks, say) may listen on the same port
    number, and a process in a private network has no listener here at all."""
    try:
        with socket.create_connection((address, port), timeout=2):
            pass
    except OSError:
        return False
    listeners = set()
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                listeners.add(fields[9])
    return bool(listeners & set().union(*(socket_inodes(pid) for pid in pids)))


def wait_for(path, process, bound_seconds=LAUNCH_BOUND_SECONDS):
    deadline = time.monotonic() + bound_seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"no {path.name} in {bound_seconds} s"
        time.sleep(0.2)


def probed_launch(tmp_path, strategy, ps=0, network=None):
    """Runs a launch, probes its tasks' listeners from outside; returns (listeners by
    task, the (address, port) pairs that accepted, the chief's result)."""
    out = tmp_path / f"{strategy}-{network or 'default'}"
    out.mkdir()
    options = ["--ps", str(ps)] if ps else []
    options += ["--network", network] if network else []
    process = subprocess.Popen([TFDIST, "launch", "-n", "2", *options, "--", sys.executable,
                                SCRIPT, str(out), "--strategy", strategy],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, stdin=subprocess.DEVNULL)
    try:
        wait_for(out / "ready", process)
        time.sleep(1)  # the other tasks' servers: started with the chief's, or before it
        listeners = {path.stem: listening_ports(int(path.read_text()))
                     for path in out.glob("*.pid")}
        pids = [int(path.read_text()) for path in out.glob("*.pid")]
        accepted = [(address, port) for ports in listeners.values() for port in ports
                    for address in machine_addresses() if reached(pids, address, port)]
        (out / "probed").touch()
        output, _ = process.communicate(timeout=LAUNCH_BOUND_SECONDS)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output[-3000:]
    return listeners, accepted, json.loads((out / "result.json").read_text()), output


def test_this_machine_has_an_address_beyond_loopback_to_probe():
    assert machine_addresses(), "no interface but loopback: the probes would prove nothing"


@pytest.mark.parametrize("strategy, ps", [("multi_worker", 0), ("parameter_server", 1)])
def test_a_launch_listens_on_no_address_beyond_loopback(tmp_path, strategy, ps):
    listeners, accepted, result, output = probed_launch(tmp_path, strategy, ps)
    expected = {"worker-0", "worker-1"} | ({"chief-0", "ps-0"} if ps else set())
    assert set(listeners) == expected
    assert all(listeners.values()), listeners  # every task's server was found, and tried
    assert accepted == []
    assert "listen on every interface" not in output
    if strategy == "multi_worker":
        # The same training as on the machine's network.
        _, host_accepted, host_result, _ = probed_launch(tmp_path, strategy, network="host")
        assert host_accepted, "--network host: the servers are reachable, as before"
        assert result["loss"] == pytest.approx(host_result["loss"], abs=1e-6)


def test_without_a_private_network_the_launch_says_so_once_and_trains(tmp_path, monkeypatch):
    def unavailable(self):
        raise isolation.IsolationUnavailable("no private network namespace could be made "
                                             "here (simulated)")

    monkeypatch.setattr(isolation.PrivateNetwork, "start", unavailable)
    output = io.StringIO()
    status = launch.launch([TFDIST, "train", "--strategy", "multi_worker", "--set",
                            "train.epochs=1"], num_workers=2, output=output)
    said = output.getvalue()
    assert status == 0, said[-3000:]
    notices = [line for line in said.splitlines() if "listen on every interface" in line]
    assert notices == ["tfdist launch: the tasks' TensorFlow servers listen on every interface "
                       "of this machine and run whatever any caller sends: no private network "
                       "namespace could be made here (simulated). Allow user namespaces (or "
                       "run with CAP_SYS_ADMIN), keep their ports behind a firewall, or pass "
                       "--network host to accept this and silence it"]
    assert '"replicas": 2' in said


def test_the_private_network_has_loopback_alone(tmp_path):
    with isolation.PrivateNetwork() as network:
        inside = run_command(network.command([sys.executable, "-c",
                                              "import socket; print(socket.if_nameindex())"]),
                             cwd=tmp_path)
    assert inside.returncode == 0, inside.stderr
    assert [name for _, name in ast.literal_eval(inside.stdout)] == ["lo"]


def process_tree(pid):
    """`pid` and its descendants."""
    found, waiting = [], [pid]
    while waiting:
        current = waiting.pop()
        found.append(current)
        for thread in Path(f"/proc/{current}/task").iterdir():
            waiting += [int(child) for child in (thread / "children").read_text().split()]
    return found


def docs_mpirun_command():
    """The one-machine mpirun line of the Clusters page's Security section, as written."""
    page = (REPO / "docs" / "guide" / "clusters.md").read_text()
    (line,) = [line for line in page.splitlines() if line.startswith("tfdist isolate -- mpirun")]
    return line


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.parametrize("isolated", [True, False], ids=["as_written", "without_isolate"])
def test_the_docs_mpirun_command_leaves_no_listener_reachable(tmp_path, isolated):
    command = shlex.split(docs_mpirun_command())
    if not isolated:  # what the page's isolate prevents: mpirun's own listeners outside
        command = command[command.index("--") + 1:]
    assert command[command.index("mpirun") + 1] == "--allow-run-as-root"  # root or not
    # As a user runs it: this environment's commands (tfdist, python) on the PATH.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    process = subprocess.Popen([*command, "--set", "train.epochs=3"], cwd=tmp_path,
                               env={**os.environ, "PATH": path, "TF_CPP_MIN_LOG_LEVEL": "2"},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               stdin=subprocess.DEVNULL)
    try:
        # While the ranks train: every process of the run, and every port it listens on.
        deadline = time.monotonic() + LAUNCH_BOUND_SECONDS
        while True:
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the ranks never listened"
            tree = process_tree(process.pid)
            listeners = {pid: listening_ports(pid) for pid in tree}
            if len([pid for pid in tree if "train" in Path(f"/proc/{pid}/cmdline").read_text()
                    and listeners[pid]]) >= 2 or len(tree) > 2 and not isolated:
                break
            time.sleep(0.5)
        accepted = [(address, port) for ports in listeners.values() for port in ports
                    for address in machine_addresses() if reached(tree, address, port)]
        output, _ = process.communicate(timeout=LAUNCH_BOUND_SECONDS)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output[-3000:]
    assert any(listeners.values())  # mpirun's, at least: something was tried
    if isolated:
        assert accepted == [], accepted
    else:
        assert accepted, "mpirun alone listens beyond loopback (its PMIx server)"

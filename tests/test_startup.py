"""Start-up: a task that never comes is named within the bound, signals end a waiting
process at once, and a strategy that cannot run in the launched cluster is refused at once."""

import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

import tfdist
from tfdist.app.launch import free_ports, reserved_cluster, reserved_ports
from tfdist.quiet import is_tensorflow_log_line
from tfdist.cluster import ClusterInfo, MpiInfo, SlurmInfo, parse_tf_config
from tfdist.errors import ClusterError, ConfigError
from tfdist.startup import wait_for_peers
from tests.conftest import TFDIST, mpirun, run_command


def tf_config(addresses, index, kind="worker"):
    return json.dumps({"cluster": {"worker": addresses}, "task": {"type": kind, "index": index}})


# --- wait_for_peers, in this process ---------------------------------------------------------


def test_two_tasks_waiting_for_each_other_both_go_on():
    errors, servers, done = [], [], threading.Event()

    def task(own, peer):
        try:
            # A hang bound: 20 s ran out once in a fresh-clone run under extra load.
            wait_for_peers(own, {"peer": peer}, timeout_seconds=60)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
            return
        # Then TensorFlow's server binds the task's port, as in a real start. The task that
        # sees its peer first stops listening, and its peer, still trying, finds the server
        # (the listener's last moments alone were missed once under load).
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("", int(own.rsplit(":", 1)[1])))
        server.listen(4)
        servers.append(server)
        done.wait(timeout=90)

    # Held while the tasks start, so no other test's cluster draws them meanwhile.
    with reserved_ports(2) as ports:
        first, second = (f"127.0.0.1:{port}" for port in ports)
        threads = [threading.Thread(target=task, args=(first, second)),
                   threading.Thread(target=task, args=(second, first))]
        for thread in threads:
            thread.start()
            time.sleep(0.5)  # the second starts later, as a slower pod would
        deadline = time.monotonic() + 90
        while len(servers) + len(errors) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        done.set()
        for thread in threads:
            thread.join(timeout=30)
        for server in servers:
            server.close()
    assert errors == [] and len(servers) == 2
    assert not any(thread.is_alive() for thread in threads)
    # Both ports are free again for TensorFlow's servers.
    for address in (first, second):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("", int(address.rsplit(":", 1)[1])))


@pytest.mark.serial  # It times the bound: alone, not beside the suite's other tests.
def test_a_peer_that_never_answers_is_named_with_its_address_after_the_bound():
    own, absent, present = (f"127.0.0.1:{port}" for port in free_ports(3))
    with socket.create_server(("127.0.0.1", int(present.rsplit(":", 1)[1]))):
        started = time.monotonic()
        with pytest.raises(ClusterError) as raised:
            wait_for_peers(own, {"worker:1": present, "worker:2": absent}, timeout_seconds=1)
    assert 1 <= time.monotonic() - started < 5
    assert str(raised.value) == (
        f"start-up: worker:2 ({absent}) never answered within cluster.startup_timeout_seconds=1;"
        f" check that every task is running and that TF_CONFIG (or multi_worker.workers) names"
        f" it at that address, or raise the bound. Received: 1 of 2 peers absent")


def test_a_port_another_program_holds_is_one_line():
    (port,) = free_ports(1)
    with socket.create_server(("", port)):
        with pytest.raises(ClusterError, match=rf"^start-up: port {port} of this task "
                                               rf"\(127.0.0.1:{port}\) is in use by another "
                                               r"program; free it, or give this task another "
                                               r"port in TF_CONFIG\."):
            wait_for_peers(f"127.0.0.1:{port}", {"worker:1": "127.0.0.1:1"}, timeout_seconds=1)


def test_the_bound_is_a_config_key_with_a_default_of_minutes():
    assert tfdist.load_config().cluster.startup_timeout_seconds == 300
    with pytest.raises(ConfigError, match=r"^cluster.startup_timeout_seconds must be a number "
                                          r"of seconds > 0\. Received: "):
        tfdist.load_config(overrides={"cluster.startup_timeout_seconds": 0})


# --- a one-process strategy in one of several processes ----------------------------------


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
@pytest.mark.parametrize("cluster, why, use", [
    (ClusterInfo(tf_config=parse_tf_config(tf_config(["a:1", "b:2"], 1))),
     "TF_CONFIG makes this process one of 2 tasks", "multi_worker"),
    (ClusterInfo(mpi=MpiInfo(rank=0, size=2, local_rank=0, local_size=2, launcher="mpirun")),
     "mpirun started 2 ranks", "horovod"),
    (ClusterInfo(slurm=SlurmInfo(job_id="7", proc_id=0, num_tasks=2, local_id=0,
                                 node_list="n1")),
     "Slurm started 2 tasks", "multi_worker"),
], ids=["tf_config", "mpirun", "slurm"])
def test_a_one_process_strategy_in_one_of_several_processes_is_refused(strategy, cluster, why,
                                                                       use):
    config = tfdist.load_config(overrides={"strategy": strategy})
    with pytest.raises(ConfigError) as raised:
        tfdist.Runner(config, cluster=cluster)
    assert str(raised.value) == (
        f"strategy {strategy} trains in one process, but {why}: each would train alone and "
        f"overwrite the others' files. Use --strategy {use} (or auto), or start one process. "
        f"Received: strategy={strategy}, {why}")


@pytest.mark.parametrize("cluster, why, tasks", [
    (ClusterInfo(tf_config=parse_tf_config(tf_config(["a:1", "b:2", "c:3"], 1))),
     "TF_CONFIG makes this process one of 3 tasks", 3),
    (ClusterInfo(slurm=SlurmInfo(job_id="7", proc_id=0, num_tasks=2, local_id=0,
                                 node_list="n1")),
     "Slurm started 2 tasks", 2),
], ids=["tf_config", "slurm"])
def test_a_one_rank_horovod_world_in_one_of_several_processes_is_refused(cluster, why, tasks):
    from tfdist.adapters.base import check_horovod_world

    with pytest.raises(ConfigError) as raised:
        check_horovod_world(1, cluster)
    assert str(raised.value) == (
        f"strategy horovod sees 1 rank, but {why}: each would train alone and overwrite the "
        f"others' files. Start Horovod's ranks with its own launcher (mpirun -np {tasks} ... "
        f"or horovodrun -np {tasks} ...), or use --strategy multi_worker under tfdist launch. "
        f"Received: strategy=horovod, 1 Horovod rank, {why}")
    # Horovod's launcher made the ranks: its world is theirs; a process alone is one rank.
    assert check_horovod_world(3, cluster) is False
    assert check_horovod_world(1, ClusterInfo()) is True


def test_a_side_car_evaluator_of_a_cluster_may_evaluate_on_one_device():
    evaluator = parse_tf_config(json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:2"]},
                                            "task": {"type": "evaluator", "index": 0}}))
    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device"}),
                           cluster=ClusterInfo(tf_config=evaluator))
    assert runner.num_replicas == 1


# --- real processes ------------------------------------------------------------------------


def start_task(tmp_path, cluster, kind, index, *arguments):
    """`tfdist train ARGUMENTS` as task `kind:index` of `cluster`, its output in files of
    its own (`<kind><index>.out`, `.err`)."""
    out = open(tmp_path / f"{kind}{index}.out", "w")
    err = open(tmp_path / f"{kind}{index}.err", "w")
    task_config = json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})
    process = subprocess.Popen(
        [TFDIST, "train", *arguments], cwd=tmp_path, stdout=out, stderr=err,
        stdin=subprocess.DEVNULL,
        # As a user runs it: no TF_CPP_MIN_LOG_LEVEL, so tfdist hides TensorFlow's log.
        env={**{name: value for name, value in os.environ.items()
                if name != "TF_CPP_MIN_LOG_LEVEL"}, "TF_CONFIG": task_config},
        # As at a terminal: Ctrl-C raises KeyboardInterrupt (a test runner may ignore SIGINT).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out.close()
    err.close()
    return process


def start_worker(tmp_path, addresses, index, *extra):
    """`tfdist train --strategy multi_worker` as worker `index` of `addresses`."""
    return start_task(tmp_path, {"worker": addresses}, "worker", index,
                      "--strategy", "multi_worker", "--set", "train.epochs=1", *extra)


@pytest.mark.multiprocess
def test_a_worker_that_never_starts_ends_the_others_within_the_bound_with_one_line(tmp_path):
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]
    bound = 5
    started = time.monotonic()
    workers = [start_worker(tmp_path, addresses, index, "--set",
                            f"cluster.startup_timeout_seconds={bound}") for index in (0, 1)]
    for worker in workers:
        worker.wait(timeout=bound + 60)
    elapsed = time.monotonic() - started
    for index, worker in enumerate(workers):
        err = (tmp_path / f"worker{index}.err").read_text()
        assert worker.returncode == 1, err[-2000:]
        assert err.strip().splitlines() == [
            f"tfdist: error: start-up: worker:2 ({addresses[2]}) never answered within "
            f"cluster.startup_timeout_seconds={bound}; check that every task is running and "
            f"that TF_CONFIG (or multi_worker.workers) names it at that address, or raise the "
            f"bound. Received: 1 of 2 peers absent"]
    assert elapsed < bound + 15 + 10  # the bound + 15 s, plus the processes' start (~5 s here)


@pytest.mark.multiprocess
@pytest.mark.parametrize("signal_number, status", [(signal.SIGTERM, -signal.SIGTERM),
                                                   (signal.SIGINT, 130)])
def test_a_signal_while_waiting_for_a_peer_ends_every_process_at_once(signal_number, status,
                                                                      tmp_path):
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]
    workers = [start_worker(tmp_path, addresses, index) for index in (0, 1)]
    # Wait until both are waiting: each has its port open for the other.
    deadline = time.monotonic() + 60
    for address in addresses[:2]:
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])),
                                         timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
    for worker in workers:
        worker.send_signal(signal_number)
    signalled = time.monotonic()
    for worker in workers:
        worker.wait(timeout=60)
    # Unanswered, the wait would last cluster.startup_timeout_seconds (300 s). Ending takes
    # about a second alone, and 5.4 s was seen under the suite's load: 20 s tells the two
    # apart without measuring the machine's load.
    assert time.monotonic() - signalled < 20
    assert [worker.returncode for worker in workers] == [status, status]
    for index in (0, 1):
        assert "Traceback" not in (tmp_path / f"worker{index}.err").read_text()


@pytest.mark.multiprocess
@pytest.mark.parametrize("launch, strategy, line", [
    (["-n", "2", "--ps", "1"], "multi_worker",
     "tfdist: error: strategy multi_worker trains on chief and worker tasks only, and TF_CONFIG "
     "names 1 ps tasks, which would wait for ever: use --strategy parameter_server (or auto), "
     "or drop the ps tasks (tfdist launch without --ps). Received: cluster with chief, ps, "
     "worker"),
    (["-n", "2"], "mirrored",
     "tfdist: error: strategy mirrored trains in one process, but TF_CONFIG makes this process "
     "one of 2 tasks: each would train alone and overwrite the others' files. Use --strategy "
     "multi_worker (or auto), or start one process. Received: strategy=mirrored, TF_CONFIG "
     "makes this process one of 2 tasks"),
    pytest.param(["-n", "2"], "horovod",
                 "tfdist: error: strategy horovod sees 1 rank, but TF_CONFIG makes this process "
                 "one of 2 tasks: each would train alone and overwrite the others' files. Start "
                 "Horovod's ranks with its own launcher (mpirun -np 2 ... or horovodrun -np 2 "
                 "...), or use --strategy multi_worker under tfdist launch. Received: "
                 "strategy=horovod, 1 Horovod rank, TF_CONFIG makes this process one of 2 tasks",
                 marks=pytest.mark.requires_horovod),
], ids=["multi_worker_beside_ps", "mirrored_under_launch", "horovod_under_launch"])
def test_a_strategy_the_launched_cluster_cannot_run_is_refused_by_every_task_at_once(
        launch, strategy, line, tmp_path):
    # Each task of the cluster `tfdist launch LAUNCH` makes, started on its own (as a
    # scheduler would, with no launcher to stop the others): every one, ps tasks included,
    # refuses by itself.
    num_workers, num_ps = int(launch[1]), int(launch[3]) if "--ps" in launch else 0
    with reserved_cluster(num_workers, num_ps) as cluster:
        started = time.monotonic()
        tasks = {(kind, index): start_task(tmp_path, cluster, kind, index, "--strategy",
                                           strategy)
                 for kind, addresses in cluster.items()
                 for index in range(len(addresses))}
        for process in tasks.values():
            process.wait(timeout=90)
    assert time.monotonic() - started < 60
    for kind, index in tasks:
        err = (tmp_path / f"{kind}{index}.err").read_text()
        said = [text for text in err.splitlines()
                if text.strip() and not is_tensorflow_log_line(text)]
        assert (tasks[kind, index].returncode, said) == (2, [line]), (kind, index, err[-3000:])


@pytest.mark.multiprocess
@pytest.mark.requires_mpi
@pytest.mark.refuses
def test_a_one_process_strategy_under_mpirun_is_refused_by_every_rank(tmp_path):
    result = run_command(mpirun("--output-filename", str(tmp_path / "ranks"), TFDIST, "train",
                                "--strategy", "one_device"), cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    errors = sorted((tmp_path / "ranks").glob("*/rank.*/stderr"))
    assert len(errors) == 2
    refusal = ("tfdist: error: strategy one_device trains in one process, but openmpi started "
               "2 ranks: each would train alone and overwrite the others' files. Use --strategy "
               "horovod (or auto), or start one process. Received: strategy=one_device, "
               "openmpi started 2 ranks")
    # TensorFlow's C++ start-up lines pass TF_CPP_MIN_LOG_LEVEL and may come after the
    # refusal; and mpirun stops the other rank as soon as one exits with an error, so a
    # slower rank may be stopped before it gets as far: each says the refusal or nothing.
    said = [[line for line in path.read_text().splitlines()
             if line.strip() and not is_tensorflow_log_line(line)] for path in errors]
    assert [refusal] in said and all(lines in ([refusal], []) for lines in said), said

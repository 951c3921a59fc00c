"""Cluster detection reads what real launchers set: TF_CONFIG, Slurm, MPI, TPU."""

import json

import pytest

from tfdist.cluster import ClusterInfo, cpu_steal_fraction, detect_cluster, parse_tf_config
from tfdist.errors import ConfigError


def detect(env, **kwargs):
    return detect_cluster(env, probe_gpus=False, **kwargs)


def test_empty_environment():
    info = detect({}, dev_dir="/nonexistent")
    assert (info.tf_config, info.slurm, info.mpi, info.tpu) == (None, None, None, None)
    assert info.cpu_cores >= 1


def test_kubeflow_tfjob_tf_config():
    # The format Kubeflow's training operator sets for a TFJob with a chief and 2 workers.
    tf_config = {
        "cluster": {"chief": ["train-chief-0.ns.svc:2222"],
                    "worker": ["train-worker-0.ns.svc:2222", "train-worker-1.ns.svc:2222"]},
        "task": {"type": "worker", "index": 1},
        "environment": "cloud",
    }
    info = detect({"TF_CONFIG": json.dumps(tf_config)})
    assert info.tf_config.task_type == "worker"
    assert info.tf_config.task_index == 1
    assert info.tf_config.num_workers == 3
    assert not info.tf_config.is_chief


def test_worker_zero_is_chief_without_a_chief_task():
    info = parse_tf_config(json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                                       "task": {"type": "worker", "index": 0}}))
    assert info.is_chief


def test_slurm_variables():
    env = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "node[01-02]"}
    assert detect(env).slurm.__dict__ == {"job_id": "77", "proc_id": 3, "num_tasks": 4,
                                          "local_id": 1, "node_list": "node[01-02]",
                                          "tasks_per_node": ""}


@pytest.mark.parametrize("env, launcher", [
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "openmpi"),
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1",
      "HOROVOD_LOCAL_SIZE": "2"}, "horovodrun"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, "mpich"),
])
def test_mpi_ranks(env, launcher):
    mpi = detect(env).mpi
    assert ((mpi.rank, mpi.size, mpi.local_rank, mpi.local_size, mpi.launcher)
            == (1, 2, 1, 2, launcher))


def test_tpu_sources(tmp_path):
    assert detect({"TPU_NAME": "my-tpu"}).tpu.name == "my-tpu"
    assert detect({"COLAB_TPU_ADDR": "10.0.0.2:8470"}).tpu.name == "grpc://10.0.0.2:8470"
    (tmp_path / "accel0").touch()
    assert detect({}, dev_dir=str(tmp_path)).tpu.name == "local"


def test_cpu_bf16_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n")
    assert detect({}, cpuinfo_path=str(cpuinfo)).cpu_bf16
    cpuinfo.write_text("processor: 0\nflags\t\t: fpu sse avx2\n")
    assert not detect({}, cpuinfo_path=str(cpuinfo)).cpu_bf16


@pytest.mark.parametrize("text, fragment", [
    ('{"cluster": ', "not valid JSON"),
    ('{"task": {"type": "worker", "index": 0}}', "non-empty \"cluster\""),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 2}}',
     "index 2 is out of range"),
    ('{"cluster": {"chief": ["a:1", "b:2"]}, "task": {"type": "chief", "index": 0}}',
     "more than one chief"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "ps", "index": 0}}', "not in the cluster"),
    ('{"cluster": {"boss": ["a:1"]}, "task": {"type": "boss", "index": 0}}', "unknown task type"),
    ('{"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}', "host:port"),
    ('{"cluster": {"worker": ["a:1"]}}', "needs \"task\""),
])
def test_malformed_tf_config(text, fragment):
    with pytest.raises(ConfigError, match=fragment) as raised:
        detect({"TF_CONFIG": text})
    assert "\n" not in str(raised.value)


def test_malformed_launcher_variable():
    with pytest.raises(ConfigError, match="OMPI_COMM_WORLD_RANK must be an integer"):
        detect({"OMPI_COMM_WORLD_RANK": "one", "OMPI_COMM_WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match=r"must be in \[0, OMPI_COMM_WORLD_SIZE\)"):
        detect({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"})


def test_real_process_environment_is_read():
    assert isinstance(detect_cluster(), ClusterInfo)


def test_slurm_job_step_lays_out_one_worker_per_task():
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
           "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "node[02,01]",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "1"}
    slurm = detect(env).slurm
    assert (slurm.proc_id, slurm.num_tasks, slurm.local_id) == (3, 4, 1)
    assert slurm.worker_addresses() == ["node01:8888", "node01:8889", "node02:8888", "node02:8889"]


def test_slurm_task_count_that_does_not_match_the_nodes():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NODELIST": "n[1-2]",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    with pytest.raises(ConfigError, match="4 task slots on n\\[1-2\\] but 3 tasks"):
        detect(env).slurm.worker_addresses()


def test_last_level_cache_size_from_sysfs(tmp_path):
    for index, (level, size) in enumerate([(1, "48K"), (1, "32K"), (2, "2048K"), (3, "32768K")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "size").write_text(f"{size}\n")
    info = detect_cluster({}, probe_gpus=False, cpu_cache_dir=str(tmp_path))
    assert info.cpu_cache_bytes == 32 * 2**20
    assert detect_cluster({}, probe_gpus=False,
                          cpu_cache_dir=str(tmp_path / "absent")).cpu_cache_bytes == 0


def test_steal_fraction_between_two_readings(tmp_path):
    stat = tmp_path / "stat"
    #                user nice system idle iowait irq softirq steal
    stat.write_text("cpu  100 0 50 800 0 0 0 50 0 0\ncpu0 1 2 3\n")
    since_boot, counters = cpu_steal_fraction(stat_path=str(stat))
    assert since_boot == pytest.approx(50 / 1000) and counters == (50, 1000)
    stat.write_text("cpu  150 0 50 1000 0 0 0 100 0 0\n")
    steal, _ = cpu_steal_fraction(since=counters, stat_path=str(stat))
    assert steal == pytest.approx(50 / 300)
    assert cpu_steal_fraction(stat_path=str(tmp_path / "absent")) == (0.0, (0, 0))


def test_ephemeral_port_range_is_read_from_linux_or_falls_back_to_iana(tmp_path):
    from tfdist.cluster import ephemeral_port_range

    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t50000\n")
    assert ephemeral_port_range(str(ranges)) == (40000, 50000)
    assert ephemeral_port_range(str(tmp_path / "absent")) == (49152, 65535)
    ranges.write_text("garbage\n")
    assert ephemeral_port_range(str(ranges)) == (49152, 65535)

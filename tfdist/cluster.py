"""What this process runs on: devices, and the cluster a launcher placed it in.

This is the one module that reads the environment (variables, /proc, /dev).
Everything else receives a `ClusterInfo`. Each source is what an existing
engine gives a process:

- `TF_CONFIG`: Kubeflow's TFJob, `tfdist launch`, or a user (JSON).
- Slurm: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_JOB_NODELIST`.
- MPI: Open MPI's `OMPI_COMM_WORLD_*`, MPICH's `PMI_*`, or `horovodrun`'s `HOROVOD_*`.
- TPU: `TPU_NAME`, Colab's `COLAB_TPU_ADDR`, or a TPU VM's `/dev/accel*`.
- `tfdist supervise`: `TFDIST_SUPERVISOR_FOLDER`, where training processes register.

Example:

    info = detect_cluster()
    info.gpus, info.tf_config, info.mpi
    detect_cluster({"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:2"]},'
                                 ' "task": {"type": "worker", "index": 1}}'}, probe_gpus=False)
"""

from __future__ import annotations

import dataclasses
import glob
import ipaddress
import json
import os
import socket
from typing import Any, Mapping, Sequence

from tfdist.errors import ConfigError

# Task types TF_CONFIG may name. `evaluator` runs beside a cluster, outside its spec.
_TASK_TYPES = ("chief", "worker", "ps", "evaluator")


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as TensorFlow sees it."""

    name: str
    compute_capability: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class TFConfigInfo:
    """A parsed, checked `TF_CONFIG`.

    Args:
        cluster: Task type to its list of `host:port` addresses.
        task_type: This process's type: chief, worker, ps or evaluator.
        task_index: This process's index within its type.
    """

    cluster: Mapping[str, tuple[str, ...]]
    task_type: str
    task_index: int

    @property
    def num_workers(self) -> int:
        """Processes that compute gradients: the chief and the workers."""
        return len(self.cluster.get("chief", ())) + len(self.cluster.get("worker", ()))

    @property
    def is_chief(self) -> bool:
        """The chief, or worker 0 when the cluster names no chief."""
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0


@dataclasses.dataclass(frozen=True)
class SlurmInfo:
    """This task's place in a Slurm job step.

    Args:
        job_id: SLURM_JOB_ID.
        proc_id: This task's rank in the step (SLURM_PROCID).
        num_tasks: Tasks in the step.
        local_id: This task's rank on its node.
        node_list: The step's nodes, compressed as Slurm writes them ("node[01-02]").
        tasks_per_node: Tasks on each node, compressed as Slurm writes them ("2(x2)").
    """

    job_id: str
    proc_id: int
    num_tasks: int
    local_id: int
    node_list: str
    tasks_per_node: str = ""

    def worker_addresses(self, port_base: int = 8888) -> list[str]:
        """One `host:port` per task, hosts sorted, ranks in Slurm's block order.

        The same layout as TensorFlow's `SlurmClusterResolver`, which cannot be used
        itself on nodes without GPUs (it hands out tasks by GPU, so such a node gets
        none). Its hostlist parsers are reused.
        """
        from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm

        hosts = slurm.expand_hostlist(self.node_list)
        counts = (slurm.expand_tasks_per_node(self.tasks_per_node) if self.tasks_per_node
                  else [self.num_tasks // max(1, len(hosts))] * len(hosts))
        addresses = [f"{host}:{port_base + offset}"
                     for host, count in sorted(zip(hosts, counts)) for offset in range(count)]
        if len(addresses) != self.num_tasks:
            raise ConfigError(f"Slurm lists {len(addresses)} task slots on {self.node_list} but "
                              f"{self.num_tasks} tasks; run the job step with srun. Received: "
                              f"SLURM_STEP_TASKS_PER_NODE={self.tasks_per_node!r}")
        return addresses


@dataclasses.dataclass(frozen=True)
class MpiInfo:
    """This process's rank as an MPI or Horovod launcher set it."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str


@dataclasses.dataclass(frozen=True)
class TpuInfo:
    """Where a TPU was found: a name or address for `TPUClusterResolver`, or 'local'."""

    name: str
    source: str


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """Everything tfdist knows about where this process runs.

    Args:
        cpu_cores: Cores this process may use.
        cpu_bf16: The CPU has bfloat16 matrix instructions (AVX512_BF16 or AMX).
        cpu_model: The CPU's model name, as /proc/cpuinfo gives it ("" if unknown).
        cpu_cache_bytes: The size of the CPU's last-level cache (0 if unknown).
        cache_dir: Where tfdist keeps what it measured about this machine
            ($XDG_CACHE_HOME/tfdist, by default ~/.cache/tfdist).
        gpus: Physical GPUs TensorFlow sees.
        tf_config: The parsed TF_CONFIG, if set.
        slurm: The Slurm task, if inside a job step.
        mpi: The MPI/Horovod rank, if started by mpirun or horovodrun.
        tpu: Where a TPU was found, if anywhere.
    """

    cpu_cores: int = 1
    cpu_bf16: bool = False
    cpu_model: str = ""
    cpu_cache_bytes: int = 0
    cache_dir: str = ""
    gpus: tuple[GpuInfo, ...] = ()
    tf_config: TFConfigInfo | None = None
    slurm: SlurmInfo | None = None
    mpi: MpiInfo | None = None
    tpu: TpuInfo | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain types, for `tfdist env` and logs."""
        return dataclasses.asdict(self)


def detect_cluster(environ: Mapping[str, str] | None = None, *, probe_gpus: bool = True,
                   cpuinfo_path: str = "/proc/cpuinfo", dev_dir: str = "/dev",
                   cpu_cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> ClusterInfo:
    """Reads the environment once and returns what it says.

    Args:
        environ: The variables to read. None: this process's environment.
        probe_gpus: Ask TensorFlow for physical GPUs (imports TensorFlow; does not
            start its runtime, so devices can still be configured afterwards).
        cpuinfo_path: Where the CPU's flags are listed.
        dev_dir: Where a TPU VM's accelerator device files are.
        cpu_cache_dir: Where Linux describes the first CPU's caches.

    Returns:
        A `ClusterInfo`.

    Raises:
        ConfigError: a malformed TF_CONFIG or launcher variable.
    """
    env = os.environ if environ is None else environ
    raw_tf_config = env.get("TF_CONFIG", "").strip()
    return ClusterInfo(
        cpu_cores=_cpu_cores(),
        cpu_bf16=_cpu_has_bf16(cpuinfo_path),
        cpu_model=_cpu_model(cpuinfo_path),
        cpu_cache_bytes=_last_level_cache_bytes(cpu_cache_dir),
        cache_dir=_cache_dir(env),
        gpus=_physical_gpus() if probe_gpus else (),
        tf_config=parse_tf_config(raw_tf_config) if raw_tf_config else None,
        slurm=_slurm(env),
        mpi=_mpi(env),
        tpu=_tpu(env, dev_dir),
    )


def parse_tf_config(text: str) -> TFConfigInfo:
    """Parses and checks a TF_CONFIG value.

    Args:
        text: JSON like `{"cluster": {"worker": ["host:port", ...]},
            "task": {"type": "worker", "index": 0}}`.

    Returns:
        A `TFConfigInfo`.

    Raises:
        ConfigError: not JSON, missing parts, an unknown task type, an index out of
            range, or more than one chief.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"TF_CONFIG is not valid JSON ({error.msg} at character {error.pos}); "
                          f"set it to {{\"cluster\": {{...}}, \"task\": {{\"type\": ..., "
                          f"\"index\": ...}}}}. Received: TF_CONFIG={_clip(text)}") from None
    if (not isinstance(data, dict) or not isinstance(data.get("cluster"), dict)
            or not data["cluster"]):
        raise ConfigError("TF_CONFIG needs a non-empty \"cluster\" mapping of task type to "
                          f"addresses. Received: TF_CONFIG={_clip(text)}")
    cluster: dict[str, tuple[str, ...]] = {}
    for task_type, addresses in data["cluster"].items():
        if task_type not in _TASK_TYPES:
            raise ConfigError(f"TF_CONFIG names an unknown task type '{task_type}'; use "
                              f"{', '.join(_TASK_TYPES[:3])}. Received: TF_CONFIG={_clip(text)}")
        if (not isinstance(addresses, list) or not addresses
                or not all(isinstance(a, str) and ":" in a for a in addresses)):
            raise ConfigError(f"TF_CONFIG cluster.{task_type} must be a non-empty list of "
                              f"'host:port' strings. Received: {addresses!r}")
        cluster[task_type] = tuple(addresses)
    if len(cluster.get("chief", ())) > 1:
        raise ConfigError("TF_CONFIG names more than one chief; a cluster has at most one "
                          f"chief, the rest are workers. Received: chief={list(cluster['chief'])}")
    task = data.get("task")
    if not isinstance(task, dict) or "type" not in task:
        raise ConfigError("TF_CONFIG needs \"task\": {\"type\": ..., \"index\": ...} naming this "
                          f"process. Received: task={task!r}")
    task_type, task_index = task["type"], task.get("index", 0)
    if not isinstance(task_index, int) or isinstance(task_index, bool) or task_index < 0:
        raise ConfigError(f"TF_CONFIG task.index must be an integer >= 0. Received: "
                          f"index={task_index!r}")
    if task_type == "evaluator":
        return TFConfigInfo(cluster, task_type, task_index)
    if task_type not in cluster:
        raise ConfigError(f"TF_CONFIG task.type '{task_type}' is not in the cluster, which has "
                          f"{', '.join(cluster)}; fix task.type. Received: task={task!r}")
    count = len(cluster[task_type])
    if task_index >= count:
        raise ConfigError(f"TF_CONFIG task.index {task_index} is out of range: the cluster has "
                          f"{count} '{task_type}' task(s), indices 0 to {count - 1}; fix "
                          f"task.index. Received: task={task!r}")
    return TFConfigInfo(cluster, task_type, task_index)


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _int_var(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            prefix = name.rsplit("_", 1)[0]
            present = sorted(key for key in env if key.startswith(prefix))
            raise ConfigError(f"{name} is not set, though its launcher's other variables are; "
                              f"start the process with the launcher, or unset them all. "
                              f"Received: {', '.join(present)} set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer. Received: {name}={value!r}") from None


def _slurm(env: Mapping[str, str]) -> SlurmInfo | None:
    if "SLURM_PROCID" not in env:
        return None

    def first(*names: str) -> str:
        return next((env[name] for name in names if env.get(name)), "")

    return SlurmInfo(
        job_id=env.get("SLURM_JOB_ID", ""),
        proc_id=_int_var(env, "SLURM_PROCID"),
        num_tasks=int(first("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or 1),
        local_id=_int_var(env, "SLURM_LOCALID", 0),
        node_list=first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
        tasks_per_node=first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
    )


# (launcher, rank, size, local rank, local size), in the order they are tried.
_MPI_VARIABLES = (
    ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def _mpi(env: Mapping[str, str]) -> MpiInfo | None:
    for launcher, rank, size, local_rank, local_size in _MPI_VARIABLES:
        if rank in env:
            info = MpiInfo(rank=_int_var(env, rank), size=_int_var(env, size),
                           local_rank=_int_var(env, local_rank, 0),
                           local_size=_int_var(env, local_size, 1), launcher=launcher)
            if not 0 <= info.rank < info.size:
                raise ConfigError(f"{rank} must be in [0, {size}). "
                                  f"Received: {rank}={info.rank}, {size}={info.size}")
            return info
    return None


def _tpu(env: Mapping[str, str], dev_dir: str) -> TpuInfo | None:
    if env.get("TPU_NAME"):
        return TpuInfo(name=env["TPU_NAME"], source="TPU_NAME")
    if env.get("COLAB_TPU_ADDR"):
        return TpuInfo(name=f"grpc://{env['COLAB_TPU_ADDR']}", source="COLAB_TPU_ADDR")
    if env.get("TPU_ACCELERATOR_TYPE") or glob.glob(os.path.join(dev_dir, "accel[0-9]*")):
        return TpuInfo(name="local", source="TPU VM")
    return None


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


EPHEMERAL_PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_port_range(path: str = EPHEMERAL_PORT_RANGE_FILE) -> tuple[int, int]:
    """The ports the kernel hands out as the local end of outgoing connections.

    A server port picked inside this range can be taken, before the server binds
    it, by any process's outgoing connection (every gRPC channel makes some);
    `tfdist.app.launch.free_ports` picks below it. Linux's file, else the IANA
    range that other systems use.

    Args:
        path: The file Linux keeps the range in ("32768\t60999").

    Example:
        low, high = ephemeral_port_range()   # (32768, 60999) on a default Linux
    """
    try:
        with open(path, encoding="ascii") as stream:
            low, high = (int(field) for field in stream.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def _cpu_has_bf16(cpuinfo_path: str) -> bool:
    try:
        with open(cpuinfo_path, encoding="utf-8") as stream:
            for line in stream:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def _cpu_model(cpuinfo_path: str) -> str:
    try:
        with open(cpuinfo_path, encoding="utf-8") as stream:
            for line in stream:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _last_level_cache_bytes(cpu_cache_dir: str) -> int:
    """The largest cache of the highest level sysfs lists ("32768K" -> 33554432)."""
    caches = []
    try:
        for index in os.listdir(cpu_cache_dir):
            folder = os.path.join(cpu_cache_dir, index)
            if not index.startswith("index"):
                continue
            with open(os.path.join(folder, "level")) as level, \
                    open(os.path.join(folder, "size")) as size:
                text = size.read().strip()
                scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
                caches.append((int(level.read()), int(text.rstrip("KMG")) * scale))
    except (OSError, ValueError):
        return 0
    return max(caches)[1] if caches else 0


def cpu_steal_fraction(since: tuple[int, int] | None = None,
                       stat_path: str = "/proc/stat") -> tuple[float, tuple[int, int]]:
    """The share of CPU time the hypervisor gave to other machines (steal time).

    Args:
        since: The counters a previous call returned; None: since boot.
        stat_path: Where Linux counts CPU time.

    Returns:
        (steal / total over the interval, the counters now) — (0.0, (0, 0)) where
        the counters cannot be read.

    Example:
        _, start = cpu_steal_fraction()
        ...  # the run
        steal, _ = cpu_steal_fraction(since=start)
    """
    try:
        with open(stat_path) as stream:
            ticks = [int(value) for value in stream.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, (0, 0)
    steal = ticks[7] if len(ticks) > 7 else 0  # user nice system idle iowait irq softirq steal
    total = sum(ticks[:8])
    previous_steal, previous_total = since or (0, 0)
    interval = total - previous_total
    return ((steal - previous_steal) / interval if interval > 0 else 0.0), (steal, total)


def _cache_dir(env: Mapping[str, str]) -> str:
    base = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"),
                                                     ".cache")
    return os.path.join(base, "tfdist")


def _physical_gpus() -> tuple[GpuInfo, ...]:
    import tensorflow as tf  # Deferred: config errors should not wait for TensorFlow.

    gpus = []
    for device in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(device)
        gpus.append(GpuInfo(name=details.get("device_name", device.name),
                            compute_capability=details.get("compute_capability")))
    return tuple(gpus)


# Set by `tfdist supervise` for the launcher it runs, and so for every rank on its host.
SUPERVISOR_FOLDER_VARIABLE = "TFDIST_SUPERVISOR_FOLDER"


def supervisor_folder(environ: Mapping[str, str] | None = None) -> str | None:
    """The folder where this host's `tfdist supervise` reads its training processes, or None.

    Args:
        environ: The variables to read. None: this process's environment.

    Example:

        supervisor_folder({"TFDIST_SUPERVISOR_FOLDER": "/tmp/tfdist-supervise-x"})
    """
    env = os.environ if environ is None else environ
    return env.get(SUPERVISOR_FOLDER_VARIABLE) or None


# TensorFlow's switch for the BFC allocator on the host (read once, when it starts).
CPU_ALLOCATOR_VARIABLE = "TF_CPU_ALLOCATOR_USE_BFC"


def cpu_allocator_counts(environ: Mapping[str, str] | None = None) -> bool:
    """Whether TensorFlow's CPU allocator keeps figures: `TF_CPU_ALLOCATOR_USE_BFC` is on.

    Only the BFC allocator counts the bytes it holds. TensorFlow's plain CPU allocator
    has no figures, but how `get_memory_info` says so depends on the build and the CPU:
    it raises on some machines and answers zeros on others (seen on an AMD EPYC), so
    the variable, not the answer, decides. TensorFlow reads it as `ReadBoolFromEnvVar`
    does: "true" or "1", in any case.

    Args:
        environ: The variables to read. None: this process's environment.

    Example:

        cpu_allocator_counts({"TF_CPU_ALLOCATOR_USE_BFC": "true"})   # True
    """
    env = os.environ if environ is None else environ
    return env.get(CPU_ALLOCATOR_VARIABLE, "").strip().lower() in ("true", "1")


def child_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with `extra` on top, for a child process to inherit."""
    return {**os.environ, **extra}


def beyond_loopback(addresses: Sequence[str]) -> list[str]:
    """The `host:port` addresses, sorted, whose host is not this machine's loopback.

    A host name counts as loopback when every address it resolves to is one (a
    name that does not resolve does not count).

    Example:

        beyond_loopback(["127.0.0.1:2222", "localhost:2223", "10.0.0.7:2222"])
        # ['10.0.0.7:2222']
    """
    return sorted(address for address in set(addresses)
                  if not is_loopback(address.rsplit(":", 1)[0]))


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(resolved) and all(ipaddress.ip_address(address.split("%")[0]).is_loopback
                                  for address in resolved)


def set_default_environment(defaults: Mapping[str, str]) -> dict[str, str]:
    """Sets each variable that is not set yet, for a library that reads its settings there.

    Horovod, for one, takes its stall timeout from the environment when it starts.
    A value already set (exported by the user or the launcher) is kept.

    Args:
        defaults: Variable names and the values to give them when unset.

    Returns:
        The variables that were set now.
    """
    added = {name: value for name, value in defaults.items() if name not in os.environ}
    os.environ.update(added)
    return added

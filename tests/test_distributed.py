"""Process layout resolution (flags, JAX_* variables, SLURM), host layout of the mesh, per-process batch rows."""

import os

import pytest

from jaxllm.config.schema import ConfigError, MeshConfig, resolve_dcn
from jaxllm.runtime.distributed import DistributedError, resolve_layout
from jaxllm.parallel.mesh import make_mesh
from jaxllm.train.step import batch_sharding
from jaxllm.parallel.host_rows import process_rows

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
              "SLURM_STEP_NUM_NODES", "JAX_COORDINATOR_PORT", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE")


@pytest.fixture
def no_cluster(monkeypatch):
    for var in SLURM_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_flags_win_over_environment(no_cluster):
    env = {"JAX_COORDINATOR_ADDRESS": "other:1", "JAX_NUM_PROCESSES": "8", "JAX_PROCESS_ID": "7"}
    layout = resolve_layout("10.0.0.1:1234", 4, 2, environ=env)
    assert (layout.coordinator_address, layout.num_processes, layout.process_id, layout.source) == \
        ("10.0.0.1:1234", 4, 2, "flags")
    assert layout.host_port == ("10.0.0.1", 1234)


def test_environment_variables(no_cluster):
    env = {"JAX_COORDINATOR_ADDRESS": "pre-workers-0-0.pre:2222", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    layout = resolve_layout(environ=env)
    assert (layout.num_processes, layout.process_id, layout.source) == (4, 3, "env")
    assert layout.host_port == ("pre-workers-0-0.pre", 2222)


def test_single_process_needs_no_initialisation(no_cluster):
    assert resolve_layout(environ={}) is None
    assert resolve_layout("localhost:1234", 1, 0, environ={}) is None


def test_slurm_is_detected_with_all_gpus_per_node(no_cluster):
    for key, value in dict(SLURM_JOB_ID="77", SLURM_STEP_NODELIST="gpu[012-015]", SLURM_NTASKS="4",
                           SLURM_PROCID="2", SLURM_LOCALID="0", SLURM_STEP_NUM_NODES="4").items():
        no_cluster.setenv(key, value)
    layout = resolve_layout(environ=dict(os.environ))
    assert layout.source == "slurm" and (layout.num_processes, layout.process_id) == (4, 2)
    assert layout.coordinator_address.startswith("gpu012:")  # the first node of the step
    assert layout.local_device_ids is None  # one process per node keeps every GPU of the node
    # One process per GPU (8 tasks on 2 nodes): each process is pinned to its local GPU.
    no_cluster.setenv("SLURM_NTASKS", "8")
    no_cluster.setenv("SLURM_STEP_NUM_NODES", "2")
    no_cluster.setenv("SLURM_LOCALID", "3")
    layout = resolve_layout(environ=dict(os.environ))
    assert layout.local_device_ids == (3,)


@pytest.mark.parametrize("args, env, message", [
    (("h:1", 2, None), {}, "--process_id: missing"),
    ((None, None, None), {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, "JAX_COORDINATOR_ADDRESS: missing"),
    (("h:1", 2, 2), {}, "--process_id: 2 is outside [0, 2)"),
    (("nohost", 2, 0), {}, "--coordinator_address: expected host:port"),
    ((None, None, None), {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     "JAX_NUM_PROCESSES: expected an integer"),
])
def test_incomplete_or_bad_layouts_name_the_flag(no_cluster, args, env, message):
    with pytest.raises(DistributedError) as info:
        resolve_layout(*args, environ=env)
    assert message in str(info.value)


def test_processes_go_on_data_then_stage_then_fsdp():
    """dcn sizes in MESH_AXES order (data, fsdp, expert, context, tensor, stage); expert and tensor take hosts only when
    asked."""
    mesh = MeshConfig(data=2, fsdp=2, tensor=2, stage=1)
    assert resolve_dcn(mesh, 1).dcn_shape == (1, 1, 1, 1, 1, 1)
    assert resolve_dcn(mesh, 2).dcn_shape == (2, 1, 1, 1, 1, 1)
    assert resolve_dcn(mesh, 2).host_shape == (1, 2, 1, 1, 2, 1)
    assert resolve_dcn(MeshConfig(2, 2, 2, 2), 4).dcn_shape == (2, 1, 1, 1, 1, 2)
    assert resolve_dcn(MeshConfig(1, 4, 2, 1), 2).dcn_shape == (1, 2, 1, 1, 1, 1)
    assert resolve_dcn(MeshConfig(2, 1, 4, 1, dcn_tensor=2), 2).dcn_shape == (1, 1, 1, 1, 2, 1)  # only when asked
    assert resolve_dcn(MeshConfig(1, 1, 2, 1, expert=4, dcn_expert=2), 2).dcn_shape == (1, 1, 2, 1, 1, 1)


def test_bad_host_layouts_name_the_key():
    with pytest.raises(ConfigError, match="mesh: cannot lay 2 processes"):
        resolve_dcn(MeshConfig(1, 1, 8, 1), 2)  # tensor never crosses hosts unless asked
    with pytest.raises(ConfigError, match="mesh.dcn_data: 4 does not divide mesh.data=2"):
        resolve_dcn(MeshConfig(2, 4, 1, 1, dcn_data=4), 4)
    with pytest.raises(ConfigError, match="there are 4 processes"):
        resolve_dcn(MeshConfig(2, 4, 1, 1, dcn_data=2), 4)
    # a process's rows must be one block: an axis across hosts after a batch axis split within one strides them
    with pytest.raises(ConfigError, match=r"^mesh.dcn_expert: expert across hosts needs mesh.fsdp \(2\)"):
        resolve_dcn(MeshConfig(1, 2, 1, 1, expert=4, dcn_expert=2), 2)
    with pytest.raises(ConfigError, match=r"^mesh.dcn_fsdp: fsdp across hosts needs mesh.data \(6\)"):
        resolve_dcn(MeshConfig(6, 4, 1, 1), 4)  # the automatic layout: 2 hosts on data, 2 on fsdp


def test_a_single_process_reads_every_row():
    mesh = make_mesh(MeshConfig(2, 2, 2, 1))
    assert process_rows(batch_sharding(mesh), 16) == (0, 1)


def test_a_connect_that_reaches_itself_is_not_taken_for_process_0(monkeypatch):
    """Retrying a connect to a local port nobody listens on can pick that port as its own source (TCP
    simultaneous open): the socket then talks to itself. Seen in CI; it must read as "process 0 did not arrive"."""
    import socket

    from jaxllm.runtime import distributed
    from jaxllm.runtime.distributed import ProcessLayout, rendezvous

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    real_connect, calls = socket.create_connection, []

    def connect_to_itself_once(address, timeout=None):
        calls.append(address)
        if len(calls) > 1:
            return real_connect(address, timeout=timeout)
        sock = socket.socket()
        sock.bind(address)
        sock.connect(address)  # bound to the port it connects to: Linux connects the socket to itself
        return sock

    monkeypatch.setattr(distributed.socket, "create_connection", connect_to_itself_once)
    layout = ProcessLayout(f"127.0.0.1:{port - 1}", 2, 1, "flags")
    with pytest.raises(DistributedError, match="process 0 \\(the coordinator.*did not arrive within 1s"):
        rendezvous(layout, timeout=1)
    assert len(calls) > 1


def test_a_block_of_rows_goes_global_and_back():
    """to_local reads a block of rows from the shards that hold it, whatever the array's layout was; the
    mesh (2,2,2,1) splits a batch into 4 row shards (data x fsdp)."""
    import jax
    import numpy as np

    from jaxllm.parallel.host_rows import row_shards, to_global, to_local

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2, stage=1))
    sharding = batch_sharding(mesh)
    assert row_shards(sharding) == 4
    rows = {"tokens": np.arange(8 * 3, dtype=np.int32).reshape(8, 3), "start": np.arange(8, dtype=np.int32)}
    placed = to_global(rows, sharding, 8)
    assert placed["start"].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
    replicated = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
                  for k, v in placed.items()}
    for arrays in (placed, replicated):
        for block in ((0, 1), (1, 2), (3, 4)):
            index, count = block
            got = to_local(arrays, sharding, block)
            for name, values in rows.items():
                size = 8 // count
                np.testing.assert_array_equal(got[name], values[index * size:(index + 1) * size])


def test_sums_over_blocks_count_each_block_once():
    """Processes that hold the same block (the batch replicated over `stage` across hosts) count it once."""
    import numpy as np

    from jaxllm.parallel.host_rows import _each_block_once

    gathered = np.array([[1.0], [1.0], [5.0], [5.0]])  # processes 0, 1 hold block 0; 2, 3 block 1
    np.testing.assert_array_equal(_each_block_once(gathered, np.array([0, 0, 1, 1])).sum(axis=0), [6.0])
    np.testing.assert_array_equal(_each_block_once(gathered[[2, 0]], np.array([1, 0])), [[1.0], [5.0]])

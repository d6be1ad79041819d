"""Communication analysis (`--print_comms`): replica-group spellings, mesh-axis classification on layouts whose
collectives are known, bytes against the parameters they gather, loop trip counts."""

import math
import sys

import pytest
from flax import nnx

from jaxllm.config.cli import build_config, split_overrides
from jaxllm.config.schema import MESH_AXES, validate
from jaxllm.observe.comms import collectives, mesh_axes_of, summarize
from jaxllm.observe.replica_groups import groups_of, parse_replica_groups
from jaxllm.plan.footprint import compiled_step
from jaxllm.model.build import abstract_model

from train_runs import ROOT, TINY

sys.path.insert(0, str(ROOT / "scripts"))
import train as train_script  # noqa: E402

CONFIG = str(ROOT / "configs" / "pretrain.py")
FSDP_8 = ("--config.mesh.data=1", "--config.mesh.fsdp=8", "--config.mesh.tensor=1", "--config.mesh.stage=1")

# Lines of real HLO (XLA:CPU, jax 0.10.2) in each replica-group spelling, with the groups they name. Device ids
# are positions in a (data 2, fsdp 2, tensor 2) mesh: data = id // 4, fsdp = id // 2 % 2, tensor = id % 2.
HLO_LINES = [
    ('%all-reduce.1 = f32[64]{0} all-reduce(%x), channel_id=1, replica_groups={{0,2},{4,6},{1,3},{5,7}}, '
     'use_global_device_ids=true, to_apply=%add', [[0, 2], [4, 6], [1, 3], [5, 7]]),
    ('%all-reduce.2 = f32[] all-reduce(%x), channel_id=2, replica_groups=[4,2]<=[8], use_global_device_ids=true, '
     'to_apply=%add.1', [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ('%all-gather.3 = f32[64,4,16]{2,1,0} all-gather(%x), channel_id=3, replica_groups=[4,2]<=[4,2]T(1,0), '
     'dimensions={0}, use_global_device_ids=true', [[0, 2], [4, 6], [1, 3], [5, 7]]),
    ('%all-reduce.4 = f32[] all-reduce(%x), channel_id=4, replica_groups=[4,2]<=[2,2,2]T(2,1,0), '
     'use_global_device_ids=true, to_apply=%add.25', [[0, 4], [2, 6], [1, 5], [3, 7]]),
    ("%all-reduce.5 = f32[2,64]{1,0} all-reduce(%x), channel_id=5, replica_groups=mesh['axis_0'=4,'axis_1'=1,"
     "'axis_2'=2] {'axis_2'}, use_global_device_ids=true, to_apply=%region_9", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("%all-reduce.6 = f32[] all-reduce(%x), channel_id=6, replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], "
     "device_ids=([2,4]T(1,0)) {'axis_1'}, use_global_device_ids=true", [[0, 1], [4, 5], [2, 3], [6, 7]]),
    ("%all-reduce.7 = f32[] all-reduce(%x), channel_id=7, replica_groups=mesh['a'=8] {'a':(2)2}, "
     "use_global_device_ids=true", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("%collective-permute.8 = f32[4]{0} collective-permute(%x), channel_id=8, "
     "source_target_pairs={{0,4},{4,0},{1,5},{5,1}}", [[0, 4], [4, 0], [1, 5], [5, 1]]),
]


@pytest.mark.parametrize("line,groups", HLO_LINES, ids=["explicit", "iota", "iota-transposed", "iota-3d",
                                                        "mesh-axes", "mesh-device-ids", "sub-axis", "permute"])
def test_every_replica_group_spelling_names_its_devices(line, groups):
    assert groups_of(line) == groups


def test_groups_map_to_the_mesh_axes_they_span():
    shape = (2, 2, 1, 1, 2, 1)  # MESH_AXES order: data, fsdp, expert, context, tensor, stage
    assert mesh_axes_of([[0, 1], [2, 3], [4, 5], [6, 7]], shape, MESH_AXES) == (("tensor",), False)
    assert mesh_axes_of([[0, 2, 4, 6], [1, 3, 5, 7]], shape, MESH_AXES) == (("data", "fsdp"), False)
    assert mesh_axes_of(parse_replica_groups("[4,2]<=[2,2,2]T(2,1,0)"), shape, MESH_AXES) == (("data",), False)
    # pairs of a 4-device axis cover part of it
    assert mesh_axes_of([[0, 1], [2, 3], [4, 5], [6, 7]], (1, 8, 1, 1, 1, 1), MESH_AXES) == (("fsdp",), True)


def _cfg(*overrides):
    cd = build_config(CONFIG, split_overrides([*TINY, *overrides])[1])
    return validate(cd, 8)


def _collectives(cfg):
    names = {str(path[-1]) for path, _ in nnx.to_flat_state(nnx.state(abstract_model(cfg.model, cfg.precision)))}
    return collectives(compiled_step(cfg).as_text(), cfg.mesh.shape, MESH_AXES, names)


def _layer_bytes(cfg) -> int:
    """Bytes of one layer's weights (the stacked `layers` parameters over L)."""
    state = nnx.state(abstract_model(cfg.model, cfg.precision))
    stacked = [v for path, v in nnx.to_flat_state(state) if "layers" in map(str, path)]
    total = sum(math.prod(v.shape) * v.dtype.itemsize for v in stacked)
    return total // cfg.model.num_layers


def test_fsdp_only_every_collective_spans_fsdp_and_the_layer_gathers_move_the_layer_weights():
    cfg = _cfg(*FSDP_8)
    found, unknown = _collectives(cfg)
    assert unknown == 0 and found
    assert {c.axes for c in found} == {("fsdp",)}  # none spans tensor, data or stage
    assert all(c.bytes > 0 and c.runs >= 1 for c in found)
    layer_gathers = [c for c in found if c.kind == "all-gather" and ("Attention" in c.source or "MLP" in c.source)]
    assert layer_gathers and all(c.runs == cfg.model.num_layers for c in layer_gathers)  # once per scanned layer
    gathered = sum(c.bytes_per_step for c in layer_gathers)
    weights = _layer_bytes(cfg) * cfg.model.num_layers
    # each layer's weights are gathered for the forward pass, and at most once more for the backward pass
    assert weights <= gathered <= 2 * weights, (gathered, weights)
    assert {c.source.split(" @ ")[0] for c in layer_gathers} >= {"q_proj", "gate_proj", "down_proj"}


def test_a_tensor_layout_has_collectives_on_tensor_and_the_report_groups_them(capsys):
    cfg = _cfg()  # the default mesh: data 2, fsdp 2, tensor 2
    found, _ = _collectives(cfg)
    axes = {c.axes for c in found}
    assert ("tensor",) in axes and ("fsdp",) in axes
    assert not any("stage" in a for a in axes)
    summary = summarize(found)
    assert summary["total_bytes_per_step"] == sum(r["bytes_per_step"] for r in summary["by_kind_axes"])
    assert len(summary["top"]) == 10
    assert [c["bytes_per_step"] for c in summary["top"]] == sorted((c["bytes_per_step"] for c in summary["top"]),
                                                                 reverse=True)
    assert train_script.main(["--config", CONFIG, *TINY, "--print_comms"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("collectives of the compiled train step on mesh "
                          "data=2 x fsdp=2 x expert=1 x context=1 x tensor=2 x stage=1")
    assert "all-reduce           tensor" in out and "top 10 collectives by bytes per step:" in out


def test_compiled_plans_of_dpo_compile_its_own_step():
    """--print_comms and a compiled --dry_run of DPO compile DPO's step (the policy's forward and backward plus the
    reference's forward on the same rows), not the language-model step of the same model with its adapters."""
    def flops(objective):
        cd = build_config(str(ROOT / "configs" / f"{objective}.py"),
                          split_overrides([*TINY, "--config.checkpoint.restore_from=", "--config.lora.rank=4"])[1])
        return compiled_step(validate(cd, 8, check_batch=False)).cost_analysis()["flops"]

    ratio = flops("dpo") / flops("sft_lora")  # the same tiny model, adapters and rows
    assert 1.1 < ratio < 1.7, ratio

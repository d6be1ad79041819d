"""Every bad configuration is one line on stderr naming the key, exit code 2, and no traceback."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import train as train_script  # noqa: E402

from jaxllm.config.cli import apply_override, load_config_file  # noqa: E402
from jaxllm.config.schema import ConfigError, resolve_vocab_size, validate  # noqa: E402

CONFIG = str(ROOT / "configs" / "pretrain.py")

BAD = [
    (["--config.optim.lrr=1"], "optim.lrr: unknown key"),
    (["--config.nonsense.x=1"], "nonsense: unknown section"),
    (["--config.mesh.data=3"], "mesh: data*fsdp*expert*context*tensor*stage = 3x2x1x1x2x1 = 12 but there are 8 devices (on a CPU, "
                               "XLA_FLAGS=--xla_force_host_platform_device_count=12 before the command makes 12"),
    (["--config.mesh.data=-1", "--config.mesh.fsdp=-1"], "mesh.fsdp: only one mesh axis may be -1"),
    (["--config.model.num_heads=6", "--config.model.num_kv_heads=4"], "model.num_kv_heads: 4 must divide model.num_heads=6"),
    (["--config.model.num_heads=5", "--config.model.num_kv_heads=5"], "model.num_heads: 5 heads are not divisible by mesh.tensor=2"),
    (["--config.model.num_kv_heads=1"], "model.num_kv_heads: 1 kv heads are not divisible by mesh.tensor=2"),
    (["--config.model.num_layers=3", "--config.mesh.stage=2", "--config.mesh.data=1"],
     "model.num_layers: 3 layers are not divisible by mesh.stage*pipeline.repeats=2"),
    (["--config.model.vocab_size=513"], "model.vocab_size: 513 is not divisible by mesh.tensor=2"),
    (["--config.model.dim=257"], "model.dim: 257 is not divisible by mesh.fsdp=2"),
    (["--config.train.batch_size=6"], "train.batch_size: 6 is not divisible by mesh.data*mesh.fsdp*mesh.expert=4"),
    (["--config.mesh.sequence_parallel=true", "--config.train.seq_len=127"],
     "mesh.sequence_parallel: splits the sequence over mesh.tensor=2, which does not divide train.seq_len=127"),
    (["--config.optim.grad_accum=8"], "optim.grad_accum: train.batch_size=16 does not split into 8 micro-batches"),
    (["--config.mesh.data=1", "--config.mesh.context=2", "--config.train.seq_len=130"],
     "mesh.context: splits train.seq_len=130 into 2 * mesh.context = 4 chunks"),
    (["--config.mesh.data=1", "--config.mesh.context=2", "--config.model.attention=cudnn",
      "--config.precision.compute=bfloat16"], "model.attention: 'cudnn' does not run over a split sequence"),
    (["--config.model.context_attention=flash"], "model.context_attention: 'flash' is not one of"),
    (["--config.pipeline.schedule=pipedream"], "pipeline.schedule: 'pipedream' is not one of"),
    (["--config.pipeline.schedule=interleaved_1f1b"],
     "pipeline.repeats: schedule 'interleaved_1f1b' runs r > 1 chunks per stage, got 1"),
    (["--config.pipeline.schedule=1f1b", "--config.pipeline.repeats=2"],
     "pipeline.repeats: schedule '1f1b' runs one chunk per stage, got 2"),
    (["--config.mesh.data=1", "--config.mesh.stage=2", "--config.model.num_layers=4", "--config.pipeline.repeats=2",
      "--config.pipeline.schedule=interleaved_1f1b", "--config.pipeline.microbatches=3"],
     "pipeline.microbatches: interleaved_1f1b needs a multiple of mesh.stage=2, got 3"),
    (["--config.train.steps=abc"], "train.steps: expected an integer, got 'abc'"),
    (["--config.model.remat=sometimes"], "model.remat: 'sometimes' is not one of"),
    (["--config.precision.compute=float8"], "precision.compute: 'float8' is not one of"),
    (["--config.precision.quant=fp8"], "precision.quant: fp8 needs a GPU (this run's backend is cpu)"),
    (["--config.precision.quant=int8", "--config.precision.compute=float16"],
     "precision.quant: int8 needs precision.compute float32 or bfloat16"),
    (["--config.precision.loss_scale=static:abc"],
     "precision.loss_scale: expected auto, dynamic, none or static:<positive scale>, got 'static:abc'"),
    (["--config.optim.name=sgdx"], "optim.name: 'sgdx' is not one of"),
    (["--config.model.preset=llama_3t"], "model.preset: unknown preset 'llama_3t'"),
    (["--config.data.path=/nonexistent/store"], "data.path: no token store at /nonexistent/store"),
    (["--config.rl.placement=split"], "rl.placement: 'split' is not one of"),
    (["--config.rl.placement=disaggregated"], "rl.rollout_devices: rl.placement=disaggregated needs devices of its own"),
    (["--config.rl.rollout_devices=2"], "rl.rollout_devices: sets devices aside for rl.placement=disaggregated; "
                                        "with 'colocated' it must be 0, got 2"),
    (["--config.train.objective=grpo", "--config.rl.placement=disaggregated", "--config.rl.rollout_devices=8"],
     "rl.rollout_devices: 8 of the 8 devices leave none to train"),
    (["--config.train.objective=grpo", "--config.rl.placement=disaggregated", "--config.rl.rollout_devices=4"],
     "mesh: data*fsdp*expert*context*tensor*stage = 2x2x1x1x2x1 = 8 but there are 4 devices"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_config_is_one_line_exit_2(overrides, message, tmp_path, capsys):
    # A short job in a scratch directory: should a check go missing, the run it lets through is 2 steps long and
    # writes nowhere that matters (later overrides win over these).
    short = ["--workdir", str(tmp_path), "--config.train.steps=2", "--config.optim.warmup_steps=1",
             "--config.train.sample_tokens=0"]
    with pytest.raises(SystemExit) as exit_info:
        train_script.main(["--config", CONFIG, *short, *overrides])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("args,message", [
    (["--workdir", "/proc/jaxllm-run"], "workdir: cannot create a run directory at /proc/jaxllm-run"),
    (["--config.train.seq_len=100000"], "train.seq_len: 100000 is longer than split 'eval'"),
], ids=["workdir", "seq_len"])
def test_bad_run_setting_found_at_start_is_one_line_exit_2(args, message, shakespeare_store, tmp_path, capsys):
    """Settings only the run can check (the file system, the data) fail the same way, before anything compiles."""
    with pytest.raises(SystemExit) as exit_info:
        train_script.main(["--config", CONFIG, "--workdir", str(tmp_path / "run"),
                           f"--config.data.path={shakespeare_store}", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_missing_config_file_and_unknown_flag(capsys):
    for argv, message in ([["--config", "/no/such.py"], "no such file /no/such.py"],
                          [["--config", CONFIG, "--bogus"], "unrecognized arguments: --bogus"]):
        with pytest.raises(SystemExit) as exit_info:
            train_script.main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.smoke
def test_real_process_exit_code_and_single_line():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--config", CONFIG,
                           "--config.mesh.tensor=3"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: mesh"), proc.stderr


@pytest.mark.smoke
def test_dry_run_plans_a_70b_model_without_devices():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--config", CONFIG,
                           "--config.model.preset=llama_70b", "--config.mesh.fsdp=64", "--dry_run"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "70,553,706,496 parameters" in proc.stdout
    assert "256 devices" in proc.stdout


@pytest.mark.smoke
def test_dry_run_plans_lora_fine_tuning_of_llama_8b():
    plans = {}
    for rank in (16, 0):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--config",
                               str(ROOT / "configs" / "sft_lora.py"), "--config.model.preset=llama_8b",
                               "--config.mesh.data=1", "--config.mesh.tensor=1", "--config.mesh.fsdp=8",
                               f"--config.lora.rank={rank}", "--dry_run"], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        plans[rank] = proc.stdout
    # PEFT's count for Llama 3 8B with r16 on q_proj and v_proj: 6,815,744 of 8,037,076,992 (0.0848%).
    assert "8,037,076,992 parameters (8.04 B), 6,815,744 trainable (0.0848%)" in plans[16]
    # The adapters' AdamW state (52 MiB in all) split over the 8 replicas of what fsdp leaves whole (optim.zero1).
    assert ("frozen parameters 3.740 GiB + trainable parameters 12.000 MiB + optimizer state 6.500 MiB"
            in plans[16])
    # Full fine-tuning: the norms, which fsdp leaves whole, are split over the replicas too.
    assert "8,030,261,248 trainable (100%)" in plans[0] and "optimizer state 7.479 GiB" in plans[0]


@pytest.mark.parametrize("platform,flags,want", [
    ("gpu", set(), "bfloat16"),
    ("cpu", {"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
    ("cpu", {"asimd", "bf16"}, "bfloat16"),  # Arm's BF16 extension
    ("cpu", {"avx2", "avx512f"}, "float32"),
], ids=["gpu", "x86-avx512-bf16", "arm-bf16", "x86-avx512-without-bf16"])
def test_auto_compute_picks_bfloat16_only_where_it_is_native(platform, flags, want):
    from jaxllm.config.auto_precision import auto_compute

    dtype, reason = auto_compute(platform, flags)
    assert dtype == want and reason


def test_auto_compute_resolves_for_this_machine_and_says_why(capsys, tmp_path):
    from jaxllm.config.auto_precision import cpu_flags, resolve_compute

    native = bool({"avx512_bf16", "amx_bf16", "bf16"} & cpu_flags())
    assert resolve_compute()[0] == ("bfloat16" if native else "float32")
    assert train_script.main(["--config", CONFIG, "--config.precision.compute=auto", "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"precision.compute=auto: {resolve_compute()[0]}, "), out
    assert cpu_flags(tmp_path / "absent") == set()


@pytest.mark.parametrize("tokenizer,tensor,want", [(512, 2, 512), (500, 1, 512), (32000, 1, 32000), (32000, 4, 32256),
                                                   (50257, 2, 50432)])
def test_auto_vocab_pads_the_tokenizer_to_128_times_tensor(tokenizer, tensor, want):
    cd = load_config_file(CONFIG)
    apply_override(cd, "model.vocab_size", "auto")
    cfg = validate(cd, 8)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, tensor=tensor))
    assert resolve_vocab_size(cfg, tokenizer, "tok.model").model.vocab_size == want
    with pytest.raises(ConfigError, match="model.vocab_size: 256 is smaller than the tokenizer's 512 tokens"):
        resolve_vocab_size(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=256)), 512, "t")


def test_auto_vocab_is_sized_from_the_store_or_named_missing(shakespeare_store, capsys):
    assert train_script.main(["--config", CONFIG, "--config.model.vocab_size=auto", "--print_sharding",
                              f"--config.data.path={shakespeare_store}"]) == 0
    assert "lm_head                                      (256, 512)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        train_script.main(["--config", CONFIG, "--config.model.vocab_size=auto", "--dry_run",
                           "--config.data.path=/no/store"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.vocab_size: auto takes the tokenizer's size") and err.count("\n") == 1


@pytest.mark.parametrize("key,text,want", [
    ("mesh.data", "-1", -1), ("mesh.sequence_parallel", "yes", True), ("train.steps", "2.0", 2),
    ("optim.lr", "1", 1.0), ("model.vocab_size", "auto", 0), ("lora.targets", "q_proj,k_proj", "q_proj,k_proj"),
    ("workdir", "/tmp/x", "/tmp/x"), ("peak_flops", "1e15", 1e15),
])
def test_overrides_take_the_field_type(key, text, want):
    cd = load_config_file(CONFIG)
    apply_override(cd, key, text)
    got = cd
    for part in key.split("."):
        got = got[part]
    assert got == want and type(got) is type(want)


def test_free_form_xla_flags_keep_the_type_they_replace():
    cd = load_config_file(str(ROOT / "configs" / "gpu" / "llama_8b_h100x8.py"))
    apply_override(cd, "xla_flags.xla_gpu_enable_triton_gemm", "true")
    apply_override(cd, "xla_flags.xla_gpu_enable_command_buffer", "FUSION")
    assert cd.xla_flags.xla_gpu_enable_triton_gemm is True and cd.xla_flags.xla_gpu_enable_command_buffer == "FUSION"
    with pytest.raises(ConfigError, match=r"^xla_flags.xla_gpu_enable_triton_gemm: expected true/false, got 'maybe'$"):
        apply_override(cd, "xla_flags.xla_gpu_enable_triton_gemm", "maybe")


def test_one_parser_for_training_and_data_prep(tmp_path, capsys):
    """A training override, a config file's value, a data-prep override and a data-config file's value are
    rejected by the same coercer with the same one-line message (key, what was expected, what was given), through
    the one ConfigError class."""
    import importlib.util

    import jaxllm.data.prep_config
    import jaxllm.config.typed_config

    assert jaxllm.data.prep_config.ConfigError is ConfigError is jaxllm.config.typed_config.ConfigError
    spec = importlib.util.spec_from_file_location("prepare_data_script", ROOT / "scripts" / "prepare_data.py")
    prepare_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare_data)
    bad_file = tmp_path / "bad_steps.py"
    bad_file.write_text("import ml_collections\nfrom jaxllm.config.schema import default_config_dict\n\n\ndef get_config():\n"
                        "    d = default_config_dict().to_dict()\n    d['train']['steps'] = 12.5\n"
                        "    return ml_collections.ConfigDict(d)\n")
    data_file = tmp_path / "bad.json"
    data_file.write_text('{"clean": {"min_words": 12.5}}')
    prep_args = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--vocab_size", "400"]

    def train_error(argv):
        with pytest.raises(SystemExit) as exit_info:
            train_script.main(argv)
        assert exit_info.value.code == 2
        return capsys.readouterr().err

    def prep_error(argv):
        assert prepare_data.main(argv) == 2
        return capsys.readouterr().err

    errors = [train_error(["--config", CONFIG, "--config.train.steps=12.5"]),
              train_error(["--config", str(bad_file)]),
              prep_error([*prep_args, "--clean.min_words=12.5"]),
              prep_error([*prep_args, "--data_config", str(data_file)])]
    assert errors == ["error: train.steps: expected an integer, got '12.5'\n",
                      "error: train.steps: expected an integer, got 12.5\n",
                      "error: clean.min_words: expected an integer, got '12.5'\n",
                      "error: clean.min_words: expected an integer, got 12.5\n"]
    assert not (tmp_path / "out").exists()


def test_a_base_architecture_is_adopted_and_checked_against_the_mesh_without_a_second_validation():
    from jaxllm.config.schema import default_config_dict
    from jaxllm.runs.base_model import ARCHITECTURE, Base, adopt_architecture

    cd = default_config_dict()
    cd.mesh.update(data=2, fsdp=2, tensor=2, stage=1)
    cfg = validate(cd, 8)
    shape = {k: getattr(cfg.model, k) for k in ARCHITECTURE}
    fits = Base("jaxllm", Path("/base/7"), 7, dict(shape, num_heads=8, num_kv_heads=4, dim=512), None)
    adopted = adopt_architecture(cfg, fits)
    assert (adopted.model.num_heads, adopted.model.dim) == (8, 512) and adopted.model.remat == cfg.model.remat
    odd_heads = Base("jaxllm", Path("/base/7"), 7, dict(shape, num_heads=3, num_kv_heads=3), None)
    with pytest.raises(ConfigError) as info:
        adopt_architecture(cfg, odd_heads)
    assert info.value.key == "model.num_heads"
    assert str(info.value) == ("model.num_heads: 3 heads are not divisible by mesh.tensor=2 (with the architecture "
                               "of the base /base/7)")


def test_disaggregated_rollout_devices_split_over_the_processes():
    cd = load_config_file(CONFIG)
    for key, value in (("train.objective", "grpo"), ("rl.placement", "disaggregated"), ("rl.rollout_devices", "3"),
                       ("mesh.data", "1"), ("mesh.tensor", "1")):
        apply_override(cd, key, value)
    with pytest.raises(ConfigError, match="rl.rollout_devices: 3 rollout devices do not split over the 2 processes"):
        validate(cd, 8, num_processes=2)
    for key, value in (("rl.rollout_devices", "4"), ("rl.max_staleness", "1")):
        apply_override(cd, key, value)
    with pytest.raises(ConfigError, match="rl.max_staleness: one step off runs on one process for now, not 2"):
        validate(cd, 8, num_processes=2)


def test_elastic_shape_shrinks_data_then_fsdp_and_raises_accumulation():
    cd = load_config_file(str(ROOT / "configs" / "pretrain.py"))  # mesh data 2, fsdp 2, tensor 2; batch 16
    cd.elastic.wait_s = 30.0
    shapes = {n: validate(cd, n) for n in (8, 4, 2)}
    assert [(c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.optim.grad_accum) for c in shapes.values()] == [
        (2, 2, 2, 1), (1, 2, 2, 2), (1, 1, 2, 4)]
    assert {c.train.batch_size for c in shapes.values()} == {16}  # the global batch, and so the data order, kept
    with pytest.raises(ConfigError, match="elastic.wait_s: the mesh of 8 devices cannot shrink to 3"):
        validate(cd, 3)
    cd.elastic.wait_s = 0.0  # off: fewer devices than the mesh is the usual one-line error
    with pytest.raises(ConfigError, match="^mesh: "):
        validate(cd, 4)

"""notebooks/sharding_layouts.ipynb runs top to bottom in a fresh kernel and shows the layouts it claims to."""

import json
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "sharding_layouts.ipynb"


def _kernel_manager(tmp_path: Path) -> KernelManager:
    """A `python3` kernel that runs this interpreter (the project's venv), whatever kernelspecs the user has."""
    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (test)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")], ensure_native_kernel=False)
    return KernelManager(kernel_name="python3", kernel_spec_manager=ksm)


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel is a fresh process: strip the JAX settings conftest.py put into this process's environment,
    # so the notebook's own first cell is what gives it 8 devices.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        km=_kernel_manager(tmp_path_factory.mktemp("kernelspec")),
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute(env=env)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    return code_cells, "\n".join(_text(c) for c in code_cells)


def test_saved_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_no_cell_errored(executed):
    cells, _ = executed
    for cell in cells:
        assert not [o for o in cell.outputs if o.output_type == "error"], cell.source[:60]
        assert cell.execution_count is not None


def test_kernel_is_this_venv_with_eight_devices(executed):
    _, text = executed
    python = re.search(r"^python: (.+)$", text, re.M).group(1).strip()
    assert Path(python) == Path(sys.executable)
    assert re.search(r"^8 devices:", text, re.M), "XLA_FLAGS from the first cell did not take effect"


def test_parameter_report(executed):
    _, text = executed
    line = re.search(r"^embed_tokens\.embedding\s.*$", text, re.M).group(0)
    assert "(512, 256)" in line and "P('tensor', 'fsdp')" in line
    assert re.search(r"^lm_head\s+\(256, 512\)\s+P\('fsdp', 'tensor'\)", text, re.M)
    assert re.search(r"^layers\.mlp\.gate_proj\s+\(4, 256, 768\)\s+P\(None, 'fsdp', 'tensor'\)", text, re.M)
    # born sharded: lm_head [256, 512] split 2 x 2, each device holds [128, 256]
    assert "shard per device {(128, 256)}" in text
    assert "-> (4, 128, 384)" in text  # gate_proj shards


def test_activation_layouts(executed):
    _, text = executed
    assert "hidden [batch, seq, embed] -> [:, 0, :] (16, 256) P(('data', 'fsdp'),)" in text
    assert "logits [batch, seq, vocab] -> [:, 0, :] (16, 4096) P(('data', 'fsdp'), 'tensor')" in text
    assert re.search(r"\('batch', 'seq', 'embed'\)\s+P\(\('data', 'fsdp'\), None, None\)\s+P\(None, None, 'fsdp'\)",
                     text)


def test_sharding_drawings_show_device_labels(executed):
    cells, _ = executed
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    drawings = [ansi.sub("", o.data["text/plain"]) for c in cells for o in c.outputs
                if o.output_type == "display_data" and "text/plain" in o.data]
    assert len(drawings) == 5
    for drawing in drawings:  # rich crops a label that does not fit its block: each block must name its devices
        assert drawing.count("CPU ") in (4, 8), drawing
    assert "CPU 0,4" in drawings[0] and "CPU 3,7" in drawings[0]  # lm_head: 4 blocks, each on a data pair


def _layout_row(text, layout):
    m = re.search(rf"^{re.escape(str(layout))}\s+(\S+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)$",
                  text, re.M)
    assert m, f"no table row for {layout}"
    model, num_params, params, opt, _, fraction = m.groups()
    return dict(model=model, num_params=int(num_params.replace(",", "")), params=int(params.replace(",", "")),
                opt=int(opt.replace(",", "")), fraction=float(fraction))


def test_bytes_per_device_table(executed):
    _, text = executed
    dp, fsdp, mixed = (_layout_row(text, layout) for layout in [(8, 1, 1, 1), (1, 8, 1, 1), (2, 2, 2, 1)])
    assert dp["model"] == fsdp["model"] == mixed["model"] == "h4/kv2"
    assert dp["fraction"] == 1.0
    assert 1 / 8 <= fsdp["params"] / dp["params"] < 1 / 8 * 1.01  # only the norms stay whole
    # optim.zero1 (the default) splits the AdamW state over the data replicas: pure data parallelism holds FSDP's
    assert 1 <= dp["opt"] / fsdp["opt"] < 1.01
    assert 2 * 4 * dp["num_params"] / 8 <= dp["opt"] < 2 * 4 * dp["num_params"] / 8 * 1.01  # mu and nu, float32
    assert fsdp["params"] < mixed["params"] < dp["params"]
    # tensor=4 and 8 need more kv heads than the default model has
    assert "(1, 2, 4, 1): default model rejected (model.num_kv_heads" in text
    for layout in [(1, 2, 4, 1), (1, 1, 8, 1)]:
        row = _layout_row(text, layout)
        assert row["model"] == "h8/kv8" and row["fraction"] < 0.2
    assert re.search(r"llama_8b on \(2, 64, 1, 1, 2, 1\) \(256 devices\): 8,030,261,248 parameters", text)


def test_compiled_memory_analysis(executed):
    _, text = executed
    sizes = {name: float(mib) for name, mib in re.findall(r"(\w+)_size_in_bytes\s+([\d.]+) MiB per device", text)}
    planned = float(re.search(r"planned params \+ AdamW\s+([\d.]+) MiB per device", text).group(1))
    # The step's arguments are the train state the planner counts (parameters and AdamW moments) plus the batch
    # and a few scalars; the donated state is written in place (aliased); the activations are temporaries.
    assert planned <= sizes["argument"] < 1.05 * planned + 0.1, (sizes, planned)
    assert planned <= sizes["alias"] <= sizes["argument"], (sizes, planned)
    assert sizes["temp"] > 0, sizes

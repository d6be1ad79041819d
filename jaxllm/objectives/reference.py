"""DPO's reference log-probabilities computed once, before training (`dpo.reference="precomputed"`): the base
model scores every prepared pair, and the sums are stored with the data, so training holds no reference model at
all (full fine-tuning would otherwise need a frozen copy of every weight) and skips its forward pass.

They live in `<data.path>/reference-<base fingerprint>/{train,eval}.npy`, float32 [rows, pairs_per_row, 2]
(chosen, rejected), written atomically; a run on the same data and base reuses them, another base gets its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np

from jaxllm.data.row_prep import PreparedRows
from jaxllm.parallel.mesh import make_mesh
from jaxllm.objectives import pair_eval
from jaxllm.runs.loader import load_base
from jaxllm.train.recovery import free

FIELD = "ref_logps"  # the batch field: [B, K, 2]


def reference_logps(cfg, base, directory: Path, plain, sequence_logps, log) -> Path:
    """The directory of the base's reference log-probabilities for the prepared pairs in `directory`, computed
    now unless present. `plain` is the objective of the plain LM (no adapters) the base loads into;
    `sequence_logps(model, batch)` gives (chosen, rejected) [B, K]."""
    mesh = make_mesh(cfg.mesh)
    abstract = jax.eval_shape(lambda: plain.split(plain.build_model(jax.random.key(0)))[1])
    with jax.set_mesh(mesh):
        params, identity = load_base(base, abstract, mesh)
        out = Path(directory) / f"reference-{identity}"
        if not all((out / f"{split}.npy").is_file() for split in ("train", "eval")):
            log(f"computing reference log-probabilities of every pair with {base.path} (once, into {out})")
            out.mkdir(exist_ok=True)
            for split in ("train", "eval"):
                rows = PreparedRows(directory, split, shuffle=False)
                scored = pair_eval.score_rows(plain.graphdef, params, mesh, rows.get_rows(np.arange(len(rows))),
                                              cfg.train.batch_size,
                                              lambda model, batch: dict(zip(("chosen", "rejected"),
                                                                            sequence_logps(model, batch))))
                values = np.stack([scored["chosen"], scored["rejected"]], axis=-1).astype(np.float32)
                tmp = out / f"{split}.tmp-{os.getpid()}.npy"
                np.save(tmp, values)
                os.replace(tmp, out / f"{split}.npy")  # processes of a job write the same values
        free(params)
    return out

"""The private APIs jaxllm uses, imported the way its code imports them: a move in a new jax or orbax release
fails here with the module's name and the range pyproject.toml pins, not deep inside a run."""

import re
import tomllib
from importlib import metadata
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxllm.runs.checkpoint import _array_registry
from jaxllm.runtime.distributed import _detected_cluster
from jaxllm.model.cudnn_attention import private_cudnn_attention
from jaxllm.model.quant import weight_einsum

ROOT = Path(__file__).resolve().parents[1]

# (private module, the distribution it ships in, the jaxllm function that imports and uses it)
PRIVATE = [
    ("orbax.checkpoint._src.metadata / ._src.serialization", "orbax-checkpoint", "jaxllm/runs/checkpoint.py",
     _array_registry),
    ("jax._src.cudnn.fused_attention_stablehlo", "jax", "jaxllm/model/cudnn_attention.py", private_cudnn_attention),
    ("jax._src.clusters", "jax", "jaxllm/runtime/distributed.py", lambda: _detected_cluster({})),
    ("qwix._src.core.dot_general_qt", "qwix", "jaxllm/model/quant.py",
     lambda: weight_einsum("ab,bc->ac", jnp.ones((2, 4)), jnp.ones((4, 3)), "int8")),
]


def pinned_range(distribution: str) -> str:
    """The requirement pyproject.toml pins `distribution` to, e.g. 'jax>=0.10.2,<0.13'."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d for d in deps if re.match(rf"{re.escape(distribution)}\s*[<>=!~]", d))


@pytest.mark.smoke
@pytest.mark.parametrize("module,distribution,site,use", PRIVATE, ids=[p[0].split(" ")[0] for p in PRIVATE])
def test_private_import_is_where_jaxllm_expects_it(module, distribution, site, use):
    try:
        use()
    except (ImportError, AttributeError, TypeError) as exc:
        pytest.fail(f"{module} moved or changed in {distribution} {metadata.version(distribution)} "
                    f"({type(exc).__name__}: {exc}); jaxllm is tested with {pinned_range(distribution)} "
                    f"(pyproject.toml): update {site}", pytrace=False)


@pytest.mark.smoke
@pytest.mark.parametrize("distribution", ["jax", "flax", "orbax-checkpoint", "qwix"])
def test_jax_flax_and_orbax_are_pinned_from_above(distribution):
    assert "<" in pinned_range(distribution), f"pyproject.toml: {distribution} needs an upper bound (the versions tested)"

"""Steps of a compiled train step run in the test process, the state after the first one checkpointed on request:
the resume tests of optimizer variants (tests/test_offload.py, tests/test_muon.py)."""

from jaxllm.runs.checkpoint import Checkpointer


def run_steps(step, state, batch_at, steps: int, directory=None):
    """(the state after `steps` calls of `step` on `batch_at(i)`, their losses); with `directory`, the state after
    the first call is saved there as step 1."""
    losses = []
    for i in range(steps):
        state, metrics = step(state, batch_at(i))
        losses.append(float(metrics["loss"]))
        if directory is not None and i == 0:
            checkpointer = Checkpointer(directory, async_save=False, log=lambda msg: None)
            checkpointer.save(1, state, {}, {})
            checkpointer.close()
    return state, losses

"""What XLA compiles the suite's programs with (tests/conftest.py puts TEST_PROCESS_FLAGS into XLA_FLAGS for the test
processes and the subprocesses they start), and the options a test passes to a compile whose exact form it asserts
(its copies, its loops, its bits) so that it sees the program users' runs get.

The suite's programs are tiny and run a few steps each, so its time is XLA's compiler:
- backend optimisation level 0: most of LLVM's optimisation passes skipped; these programs compile in about
  half the time and run no slower at these sizes. Their float results do not change.
- jaxlib 0.10's XLA emits each fusion through its new MLIR fusion emitters, which took half of what was left of
  a tiny train step's compile (two layouts 6.8 -> 3.7 s here); the older emitters compile them at once. Their
  fusions round a few values differently in the last bits, lay out an array or loop otherwise, so the tests of
  bitwise equality, of the step's copies and of its loops compile with the new emitters (PRODUCTION_COMPILE).
  jaxlib 0.12 no longer knows the flag (XLA aborts on an unknown flag), so it applies before 0.11 only.
"""

from importlib.metadata import version

OLD_EMITTERS = tuple(int(part) for part in version("jaxlib").split(".")[:2]) < (0, 11)
TEST_PROCESS_FLAGS = "--xla_backend_optimization_level=0" + (" --xla_cpu_use_fusion_emitters=false" if OLD_EMITTERS
                                                              else "")
# `compiler_options` of a compile that must be the program a user's run gets (at this optimisation level).
PRODUCTION_COMPILE = {"xla_cpu_use_fusion_emitters": True} if OLD_EMITTERS else {}

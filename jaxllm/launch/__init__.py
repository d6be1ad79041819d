"""Starting a run: the top of the house. A config with "auto" values and an objective named by
`train.objective` becomes a resolved config and a built `Objective`, handed to the shared loop
(`jaxllm.train.fit`). Nothing below this package resolves auto values or picks an objective by name.
"""

"""Training diagnostics: statistics of the model and the step, and what they say (DESIGN.md section 10)."""

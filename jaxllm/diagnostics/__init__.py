"""Diagnostics: analyses of a run's compiled program, memory and statistics that turn them into findings."""

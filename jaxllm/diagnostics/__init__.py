"""Diagnostics: statistics of a run turned into findings a person can act on (see README, Diagnostics)."""

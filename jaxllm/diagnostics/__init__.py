"""Diagnostics: metric writers, profiler traces, memory reports and step-time breakdowns."""

"""Workloads and evaluation suites."""

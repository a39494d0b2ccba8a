"""Benchmarks: the load tools built on the PolicyDesk data set (the :mod:`policydesk` package)."""

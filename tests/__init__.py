"""The test suite; :mod:`tests.support` holds the helpers shared by tests and benchmarks.

A regular package (not a namespace one), so that ``tests.support`` resolves to this folder even
where an installed distribution ships a top-level ``tests`` package of its own.
"""

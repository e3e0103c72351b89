"""Tests of torchdist's stores; ``conformance`` holds the tests every store must pass."""

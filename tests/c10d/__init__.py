"""Tests of torchdist's c10d layer."""

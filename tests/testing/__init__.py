"""Tests of torchdist's testing layer."""

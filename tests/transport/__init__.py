"""Tests of torchdist's transport layer."""

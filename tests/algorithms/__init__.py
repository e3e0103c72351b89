"""Tests of torchdist._algorithms over the loopback transport."""

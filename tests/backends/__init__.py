"""Tests of torchdist's backends layer."""

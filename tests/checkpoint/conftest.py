"""Fixtures of the checkpoint tests."""

import shutil

import pytest


@pytest.fixture
def ckpt_dir(tmp_path):
    """A scratch directory for checkpoints, removed after the test."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)

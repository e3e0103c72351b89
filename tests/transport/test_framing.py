"""The message header: layout, round trip, and fingerprints that read back as ops."""

from __future__ import annotations

import pytest
import torch

from torchdist._transport.framing import DTYPES, HEADER, Header, MsgKind, OpFingerprint, OpKind, dtype_code


def test_header_is_48_bytes_and_round_trips() -> None:
    fp = OpFingerprint.of(OpKind.REDUCE, torch.bfloat16, 123, 2, 4)
    header = Header(MsgKind.COLL, 7, 246, fp, tag=0)
    data = header.pack()
    assert len(data) == HEADER.size == 48
    assert Header.from_fields(HEADER.unpack(data)) == header


def test_fingerprint_describes_the_op() -> None:
    fp = OpFingerprint.of(OpKind.ALLREDUCE, torch.float32, 4, -1, 4)
    assert fp.describe() == "ALLREDUCE(dtype=torch.float32, numel=4, op=MAX)"
    assert OpFingerprint.of(OpKind.BROADCAST, torch.int8, 0, 1).describe() == \
        "BROADCAST(dtype=torch.int8, numel=0, root=1)"


def test_every_dtype_has_a_code_and_unknown_ones_are_rejected() -> None:
    assert [dtype_code(d) for d in DTYPES] == list(range(len(DTYPES)))
    with pytest.raises(RuntimeError, match="cannot be communicated"):
        dtype_code(torch.quint8)


def test_corrupt_header_is_reported() -> None:
    with pytest.raises(ValueError, match="out of sync"):
        Header.from_fields((99, 0, 0, 0, 0, 0, 0, 0, 0))

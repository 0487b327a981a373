"""Upload bombs against the editor's NumPy upload: a file's header is judged before a byte of its
array is allocated, an .npz's declared expansion before it is inflated, and the endpoint is
throttled. Property-based over headers an attacker may write: never an exception, never a big
allocation."""

from __future__ import annotations

import io
import struct
import tracemalloc
import warnings
import zipfile

import numpy as np
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.accounts import services as account_services
from controlplane.accounts.roles import Role
from relay_engine.core.editing_io import MAX_ARRAY_BYTES, MAX_UPLOAD_BYTES, parse_upload
from tests.reliability.figures import FIGURES

POOL = "ranking-a"
FORM = {"num_layers": "2", "num_heads": "2"}
# What parsing any refused upload may allocate: the upload itself and bookkeeping, never its claims.
SMALL_PEAK_BYTES = 4 * 1024 * 1024
PASSWORD = "correct horse battery staple"


def npy_header(descr: str, shape: tuple, fortran: bool = False) -> bytes:
    """A version 1.0 .npy header as NumPy's format documents it, declaring whatever we like."""
    text = f"{{'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {shape!r}, }}"
    pad = 64 - (10 + len(text) + 1) % 64
    body = (text + " " * pad + "\n").encode("latin1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body


def parsed_with_peak(name: str, data: bytes, **form):
    tracemalloc.start()
    try:
        result = parse_upload(name, data, rows="0 0 1", fingerprint=form or FORM)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, peak


def test_a_small_npy_declaring_75_gib_is_refused_without_allocating_it():
    bomb = npy_header("<f8", (100_000, 100_000)) + b"\x00" * 64  # 192 bytes
    assert len(bomb) == 192
    result, peak = parsed_with_peak("bomb.npy", bomb)
    assert not result.valid and peak < SMALL_PEAK_BYTES
    assert "declares shape [100000, 100000] of float64: 80000000000 bytes" in result.errors["file"][0]


def test_an_npy_holding_less_than_its_header_declares_is_refused():
    result, _ = parsed_with_peak("short.npy", npy_header("<f8", (4, 16)) + b"\x00" * 100)
    assert "declares 512 bytes of data" in result.errors["file"][0] and "holds 100" in result.errors["file"][0]


def test_a_zip_bomb_npz_is_refused_by_its_declared_expansion():
    buffer = io.BytesIO()
    zeros = np.zeros(MAX_ARRAY_BYTES // 8 - 16, dtype=np.float64)  # just under the per-array cap, each
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for key in ("directions", "layers", "heads", "alphas"):
            with z.open(f"{key}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, zeros)
    bomb = buffer.getvalue()
    assert len(bomb) < 200_000 and 4 * zeros.nbytes > MAX_UPLOAD_BYTES
    result, peak = parsed_with_peak("bomb.npz", bomb)
    assert not result.valid and "expands to" in result.errors["file"][0]
    assert peak < SMALL_PEAK_BYTES


def test_an_npz_naming_an_array_twice_is_refused():
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile warns of the duplicate it writes
        for _ in range(2):
            with z.open("directions.npy", "w") as member:
                np.lib.format.write_array(member, np.ones((1, 4)))
    result, _ = parsed_with_peak("twice.npz", buffer.getvalue())
    assert "names an array twice" in result.errors["file"][0]


DESCRS = ["<f8", "<f4", ">i8", "|u1", "<U8", "|O", "|V16", "<c16", "|b1", "bogus"]
SHAPES = st.lists(st.one_of(st.integers(0, 64), st.integers(0, 10**12), st.integers(-5, -1)), max_size=4).map(tuple)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(descr=st.sampled_from(DESCRS), shape=SHAPES, fortran=st.booleans(), body=st.binary(max_size=4096))
def test_any_declared_header_is_judged_without_an_exception_or_a_big_allocation(descr, shape, fortran, body):
    FIGURES.hostile("upload headers (hypothesis)")
    result, peak = parsed_with_peak("fuzzed.npy", npy_header(descr, shape, fortran) + body)
    assert peak < SMALL_PEAK_BYTES
    if not result.valid:
        assert result.errors


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=2048), magic=st.sampled_from([b"\x93NUMPY", b"PK\x03\x04", b""]))
def test_any_bytes_behind_a_magic_number_are_judged_without_an_exception(data, magic):
    FIGURES.hostile("upload bytes (hypothesis)")
    result, peak = parsed_with_peak("fuzzed", magic + data)
    assert not result.valid and result.errors and peak < SMALL_PEAK_BYTES


@pytest.fixture
def session(db):
    account_services.user_create(username="sre-upload", role=Role.OPERATOR, password=PASSWORD, actor="fixture")
    browser = Client()
    assert browser.login(username="sre-upload", password=PASSWORD)
    return browser


def test_the_upload_endpoint_answers_bombs_with_400_and_is_throttled(settings, session, pool):
    settings.RELAYGR_UPLOAD_THROTTLE_RATE = "3/min"
    bomb = npy_header("<f8", (100_000, 100_000)) + b"\x00" * 64
    codes = [session.post(f"/ui/pools/{POOL}/editing-upload/",
                           {"file": SimpleUploadedFile("bomb.npy", bomb), "rows": "0 0 1", **FORM}).status_code
             for _ in range(4)]
    FIGURES.hostile("upload bombs via the endpoint", len(codes))
    assert codes == [400, 400, 400, 429]


@pytest.mark.parametrize("descr", ["<f8", "<f4"])
def test_a_real_upload_still_reads_exactly(descr):
    buffer = io.BytesIO()
    np.save(buffer, np.arange(32, dtype=np.dtype(descr)).reshape(2, 16))
    result = parse_upload("ok.npy", buffer.getvalue(), rows="0 0 1\n1 1 2", fingerprint=FORM)
    assert result.valid and [e["direction"][:3] for e in result.editing["edits"]] == [[0.0, 1.0, 2.0],
                                                                                      [16.0, 17.0, 18.0]]


NUMBER_TEXT = st.one_of(st.sampled_from(["1e400", "-1e400", "9" * 400, "9" * 5000, "nan", "inf", "-0", "0x10", "1_0",
                                         "", " ", "١", "1e-400"]), st.integers().map(str), st.floats().map(repr))


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(NUMBER_TEXT, min_size=1, max_size=4).map(" ".join), max_size=3).map("\n".join),
       fingerprint=st.dictionaries(st.sampled_from(["num_layers", "num_heads", "head_dim"]), NUMBER_TEXT))
def test_the_uploads_form_numbers_are_judged_by_field_whatever_they_hold(rows, fingerprint):
    FIGURES.hostile("upload form numbers (hypothesis)")
    buffer = io.BytesIO()
    np.save(buffer, np.ones((2, 4)))
    result = parse_upload("d.npy", buffer.getvalue(), rows=rows, fingerprint=fingerprint)
    assert result.valid or all(path.startswith(("rows", "fingerprint", "editing")) for path in result.errors)

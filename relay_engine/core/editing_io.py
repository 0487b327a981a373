"""Editing configurations as files: written by the lab's workflow, read back by the editor's upload.

One place for both directions, so a file the lab writes is exactly what an upload accepts:
``editing_json`` / ``write_editing_npz`` write; ``parse_upload`` reads an uploaded file (plus the
editor's form) into the validated ``editing`` section or errors by field.

Two file formats, read with NumPy's format helpers and ``allow_pickle=False`` (no object arrays,
nothing executed). Sizes are judged before anything is allocated: each array's header (its declared
shape and dtype) against ``MAX_ARRAY_BYTES`` and against the bytes actually there, an ``.npz``'s
declared uncompressed sizes against ``MAX_UPLOAD_BYTES`` (a small file must not expand into a big one):

* ``.npy``: directions, shape ``[n_edits, head_dim]``, with a form listing one ``layer head alpha``
  line per row (commas or spaces), the fingerprint (``num_layers``, ``num_heads``; ``head_dim``
  defaults to the array's second dimension) and the scope.
* ``.npz``: arrays ``layers`` [n], ``heads`` [n], ``alphas`` [n] (or one scalar ``alpha``),
  ``directions`` [n, head_dim]; optionally ``fingerprint`` [3] (num_layers, num_heads, head_dim),
  ``scope`` (a string) and ``provenance`` (a JSON string). Low-rank maps (``h + α·Rᵀ(W·h + b − R·h)``
  on some heads of a layer) come as ``lowrank_layers`` [m], ``lowrank_heads`` [m, n],
  ``lowrank_rotation`` and ``lowrank_source_weight`` [m, rank, n·head_dim], ``lowrank_source_bias``
  [m, rank] and ``lowrank_alphas`` [m] — every map of one file has the same number of heads and
  rank (the JSON form has no such limit); with them, ``directions`` and its columns may be left
  out. ``write_editing_npz`` writes this form, so the eval's ``gr_editing.npz`` uploads to the same
  content hash as its ``gr_editing.json``. Form values, when given, win over the file's.

The section is then judged by the schema (``relay_engine.core.config.validate_policy``), exactly as a
JSON upload or an API call would be, so its errors carry the schema's paths
(``editing.edits[2].direction``). Problems the schema cannot see — an unreadable file, a row of the
form that is not three numbers, more rows than directions — are reported under ``file``, ``rows``,
``rows[i]``, ``fingerprint.*``, ``scope`` or ``provenance``.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relay_engine.core.config import EDIT_SCOPES, MAX_EDITS, EditingConfig, to_plain, validate_policy
from relay_engine.core.fields import FieldErrors, text_number

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
MAX_ARRAY_BYTES = 16 * 1024 * 1024  # uncompressed, per array: far above any real edit set
LOWRANK_ARRAYS = ("lowrank_layers", "lowrank_heads", "lowrank_rotation", "lowrank_source_weight",
                  "lowrank_source_bias", "lowrank_alphas")
NPZ_ARRAYS = {"layers", "heads", "alphas", "alpha", "directions", "fingerprint", "scope", "provenance",
              *LOWRANK_ARRAYS}
FINGERPRINT_KEYS = ("num_layers", "num_heads", "head_dim")
# An .npz's arrays together, uncompressed, as the zip declares them (MAX_EDITS × a head_dim of 128 in
# float64 is 4 MiB): far above any real edit set, far below harm.
MAX_UPLOAD_BYTES = 2 * MAX_ARRAY_BYTES


@dataclass
class UploadResult:
    field_errors: FieldErrors = field(default_factory=FieldErrors)
    editing: dict[str, Any] | None = None  # the validated section (plain JSON), when there are no errors
    content_hash: str | None = None

    @property
    def errors(self) -> dict[str, list[str]]:
        return self.field_errors.by_path

    @property
    def valid(self) -> bool:
        return not self.field_errors

    def add(self, path: str, message: str) -> None:
        self.field_errors.add(path, message)

    def to_dict(self) -> dict[str, Any]:
        return {"valid": self.valid, "errors": self.errors, "editing": self.editing,
                "content_hash": self.content_hash}


def parse_upload(name: str, data: bytes, *, rows: str = "", fingerprint: dict[str, str] | None = None,
                 scope: str = "", provenance: str = "",
                 default_fingerprint: dict[str, Any] | None = None) -> UploadResult:
    """An uploaded ``.npy``/``.npz`` plus the form's fields → the validated ``editing`` section or errors.

    ``fingerprint`` holds the form's text values (empty = not given); ``default_fingerprint`` (the live
    revision's, when it has an editing section) fills what neither the form nor the file gives.
    """
    out = UploadResult()
    fingerprint = {k: v.strip() for k, v in (fingerprint or {}).items() if v is not None and v.strip()}
    arrays = _read_arrays(name, data, out)
    if arrays is None:
        return out
    is_npz = data.startswith(ZIP_MAGIC)
    if is_npz and rows.strip():
        out.add("rows", "an .npz file carries its own layers, heads and alphas; leave the rows empty")
        return out

    lowrank = _npz_lowrank(arrays, out) if is_npz else []
    if out.errors:
        return out
    directions = arrays.get("directions")
    if directions is None and lowrank:
        directions = np.zeros((0, 0))  # a file of low-rank maps only
    if directions is None or directions.ndim != 2:
        shape = "missing" if directions is None else f"shape {list(directions.shape)}"
        out.add("file", f"directions must be a 2-D array [n_edits, head_dim], got {shape}")
        return out
    if directions.dtype.kind not in "iuf":
        out.add("file", f"directions must hold real numbers, got dtype {directions.dtype}")
        return out
    n = directions.shape[0]
    if n > MAX_EDITS:
        out.add("file", f"has {n} directions; at most {MAX_EDITS}")
        return out

    if is_npz and "directions" not in arrays:
        layers, heads, alphas = [], [], []
    elif is_npz:
        layers, heads, alphas = _npz_rows(arrays, n, out)
    else:
        layers, heads, alphas = _form_rows(rows, n, out)

    fp: dict[str, Any] = dict(default_fingerprint or {})
    if n:
        fp.setdefault("head_dim", int(directions.shape[1]))
    if "fingerprint" in arrays:
        raw = arrays["fingerprint"]
        if raw.shape != (3,) or raw.dtype.kind not in "iu":
            out.add("fingerprint", f"the file's fingerprint must be 3 integers (num_layers, num_heads, head_dim), "
                                   f"got shape {list(raw.shape)} of {raw.dtype}")
        else:
            fp.update(zip(FINGERPRINT_KEYS, (int(v) for v in raw), strict=True))
    for key in FINGERPRINT_KEYS:
        if key in fingerprint:
            value = text_number(fingerprint[key])
            if value is None:
                out.add(f"fingerprint.{key}", f"must be an integer, got {fingerprint[key]!r}")
            else:
                fp[key] = value
        elif key not in fp:
            out.add(f"fingerprint.{key}", "is required (no live editing section to take it from)")

    scope_value = scope.strip() or _npz_string(arrays, "scope", out) or "candidates"
    if scope_value not in EDIT_SCOPES:
        out.add("scope", f"must be one of {', '.join(EDIT_SCOPES)}, got {scope_value!r}")
    prov_text = provenance.strip() or _npz_string(arrays, "provenance", out) or ""
    prov: Any = {}
    if prov_text:
        try:
            prov = json.loads(prov_text)
        except ValueError as exc:
            out.add("provenance", f"must be a JSON object: {exc}")
    if not isinstance(prov, dict):
        out.add("provenance", f"must be a JSON object, got {type(prov).__name__}")
    if provenance.strip() or "provenance" not in arrays:  # not the file's own record: say where it came from
        prov = {**(prov if isinstance(prov, dict) else {}), "uploaded_file": name[:200],
                "uploaded_sha256": hashlib.sha256(data).hexdigest()}
    if out.errors:
        return out

    section = {
        "fingerprint": fp,
        "scope": scope_value,
        "edits": [{"layer": layers[i], "head": heads[i], "alpha": alphas[i], "direction": directions[i].tolist()}
                  for i in range(n)],
        "provenance": prov,
    }
    if lowrank:
        section["lowrank"] = lowrank
    spec, errors = validate_policy({"editing": section})
    if errors:
        out.errors.update(errors)
        return out
    assert spec is not None and spec.editing is not None
    out.editing = spec.to_dict()["editing"]
    out.content_hash = spec.editing.content_hash()
    return out


def _read_arrays(name: str, data: bytes, out: UploadResult) -> dict[str, np.ndarray] | None:
    """The file's arrays, each checked by its header before a byte of it is allocated."""
    try:
        if data.startswith(NPY_MAGIC):
            return {"directions": _read_npy(io.BytesIO(data), len(data), name)}
        if data.startswith(ZIP_MAGIC):
            return _read_npz(name, data)
    except UploadRefused as exc:
        out.add("file", str(exc))
        return None
    out.add("file", f"{name} is neither a .npy nor an .npz file (NumPy's formats; for JSON use the JSON upload)")
    return None


class UploadRefused(ValueError):
    """An upload that is unreadable, or declares more data than an edit set can need."""


def _read_npy(stream: io.BytesIO, size: int, what: str) -> np.ndarray:
    """One ``.npy`` of ``size`` bytes: its header's shape and dtype are judged first (a 200-byte file
    may declare 10^10 elements), and the data must be exactly what the header declares."""
    try:
        version = np.lib.format.read_magic(stream)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = read_header(stream)
    except (ValueError, OSError, EOFError, SyntaxError) as exc:
        raise UploadRefused(f"{what} is not a readable .npy array: {exc}") from None
    if dtype.hasobject:
        raise UploadRefused(f"{what} holds Python objects (dtype {dtype}): pickles are never loaded; "
                            "only numbers and text are read")
    declared = math.prod(shape) * dtype.itemsize  # Python integers: no overflow, however large the shape
    if declared > MAX_ARRAY_BYTES:
        raise UploadRefused(f"{what} declares shape {list(shape)} of {dtype}: {declared} bytes; "
                            f"at most {MAX_ARRAY_BYTES} per array")
    left = size - stream.tell()
    if left != declared:
        raise UploadRefused(f"{what} declares {declared} bytes of data (shape {list(shape)} of {dtype}) "
                            f"but holds {left}")
    stream.seek(0)  # read_array reads the header again, now known to be sound
    try:
        array = np.lib.format.read_array(stream, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise UploadRefused(f"{what} is not a readable .npy array: {exc}") from None
    return array


def _read_npz(name: str, data: bytes) -> dict[str, np.ndarray]:
    """An ``.npz`` (a zip of ``.npy``): members named, counted and sized from the zip's directory
    before any is inflated; a zip stops inflating a member at its declared size, so the total of
    declared sizes bounds what decompression can produce."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            members = z.infolist()
            names = [info.filename.removesuffix(".npy") for info in members]
            unknown = sorted({n for n in names if n not in NPZ_ARRAYS})
            if unknown:
                raise UploadRefused(f"unknown arrays {', '.join(unknown)}; allowed: {', '.join(sorted(NPZ_ARRAYS))}")
            if len(set(names)) != len(names):
                raise UploadRefused(f"{name} names an array twice")
            total = sum(info.file_size for info in members)
            if total > MAX_UPLOAD_BYTES:
                raise UploadRefused(f"{name} expands to {total} bytes; at most {MAX_UPLOAD_BYTES} in all")
            arrays = {}
            for info, key in zip(members, names, strict=True):
                with z.open(info) as stream:
                    arrays[key] = _read_npy(io.BytesIO(stream.read(info.file_size + 1)), info.file_size,
                                            f"{name}: array {key}")
            return arrays
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, OSError, EOFError) as exc:
        raise UploadRefused(f"{name} is not a readable .npz file: {exc}") from None


def _form_rows(rows: str, n: int, out: UploadResult) -> tuple[list, list, list]:
    layers, heads, alphas = [], [], []
    lines = [(i, line) for i, line in enumerate(rows.splitlines()) if line.strip() and not line.lstrip().startswith("#")]
    for row, (_, line) in enumerate(lines):
        parts = [p for p in re.split(r"[,\s]+", line.strip()) if p]
        values = [text_number(p) for p in parts]
        if len(parts) != 3 or any(v is None for v in values):
            out.add(f"rows[{row}]", f"must be three numbers 'layer head alpha', got {line.strip()!r}")
            values = [None, None, None]
        layers.append(values[0])
        heads.append(values[1])
        alphas.append(values[2])
    if len(lines) != n:
        out.add("rows", f"lists {len(lines)} row(s) of 'layer head alpha'; the file has {n} direction(s), one per row")
    return layers, heads, alphas


def _npz_rows(arrays: dict[str, np.ndarray], n: int, out: UploadResult) -> tuple[list, list, list]:
    def column(key: str) -> list:
        a = arrays.get(key)
        if a is None:
            out.add("file", f"array {key} is missing (the .npz needs layers, heads, alphas and directions)")
            return [None] * n
        if a.shape != (n,) or a.dtype.kind not in "iuf":
            out.add("file", f"array {key} must be {n} numbers (one per direction), got shape {list(a.shape)} "
                            f"of {a.dtype}")
            return [None] * n
        return a.tolist()

    layers, heads = column("layers"), column("heads")
    if "alphas" not in arrays and "alpha" in arrays and arrays["alpha"].shape == () \
            and arrays["alpha"].dtype.kind in "iuf":
        alphas = [arrays["alpha"].item()] * n
    else:
        alphas = column("alphas")
    return layers, heads, alphas


def _npz_lowrank(arrays: dict[str, np.ndarray], out: UploadResult) -> list[dict[str, Any]]:
    """The low-rank maps of an ``.npz`` as the schema's plain form ([] when the file has none); shapes
    checked here, values by the schema."""
    present = [key for key in LOWRANK_ARRAYS if key in arrays]
    if not present:
        return []
    missing = [key for key in LOWRANK_ARRAYS if key not in arrays]
    if missing:
        out.add("file", f"low-rank maps need {', '.join(LOWRANK_ARRAYS)}; missing {', '.join(missing)}")
        return []
    a = {key.removeprefix("lowrank_"): arrays[key] for key in LOWRANK_ARRAYS}
    m = a["layers"].shape[0] if a["layers"].ndim == 1 else -1
    rank = a["source_bias"].shape[1] if a["source_bias"].ndim == 2 else -1
    width = a["rotation"].shape[2] if a["rotation"].ndim == 3 else -1
    n_heads = a["heads"].shape[1] if a["heads"].ndim == 2 else -1
    expected = {"layers": (m,), "heads": (m, n_heads), "rotation": (m, rank, width),
                "source_weight": (m, rank, width), "source_bias": (m, rank), "alphas": (m,)}
    for key, shape in expected.items():
        kinds = "iu" if key in ("layers", "heads") else "iuf"
        if -1 in shape or a[key].shape != shape or a[key].dtype.kind not in kinds:
            out.add("file", f"array lowrank_{key} must be {'integers' if kinds == 'iu' else 'real numbers'} of "
                            f"shape [maps, …] consistent with the others ([m], [m, heads], [m, rank, width], "
                            f"[m, rank]), got shape {list(a[key].shape)} of {a[key].dtype}")
            return []
    return [{"layer": int(a["layers"][i]), "heads": a["heads"][i].tolist(), "alpha": float(a["alphas"][i]),
             "rotation": a["rotation"][i].tolist(), "source_weight": a["source_weight"][i].tolist(),
             "source_bias": a["source_bias"][i].tolist()} for i in range(m)]


def _npz_string(arrays: dict[str, np.ndarray], key: str, out: UploadResult) -> str | None:
    a = arrays.get(key)
    if a is None:
        return None
    if a.shape != () or a.dtype.kind != "U":
        out.add(key, f"the file's {key} must be a single string, got shape {list(a.shape)} of {a.dtype}")
        return None
    return str(a.item())


# --- writing -----------------------------------------------------------------------------------


def editing_json(editing: EditingConfig) -> dict[str, Any]:
    """Plain JSON of the section (what an operator uploads), with its content hash beside it."""
    return {"editing": to_plain(editing), "content_hash": editing.content_hash()}


def write_editing_npz(editing: EditingConfig, path: Path) -> Path:
    """The section as NumPy arrays (the editor's ``.npz`` upload): ``layers``, ``heads``, ``alphas`` [n],
    ``directions`` [n, head_dim], ``fingerprint`` [3], ``scope`` and ``provenance`` (JSON) as strings,
    and the ``lowrank_*`` arrays when the section has low-rank maps (all of one shape: else ValueError,
    use ``editing_json``). Uploaded, it validates to the same section and content hash as ``editing_json``."""
    edits, maps = editing.edits, editing.lowrank
    fp = editing.fingerprint
    arrays: dict[str, np.ndarray] = {}
    if edits or not maps:
        arrays.update(layers=np.array([e.layer for e in edits], dtype=np.int64),
                      heads=np.array([e.head for e in edits], dtype=np.int64),
                      alphas=np.array([e.alpha for e in edits], dtype=np.float64),
                      directions=np.array([e.direction for e in edits], dtype=np.float64).reshape(len(edits),
                                                                                                  fp.head_dim))
    if maps:
        if len({(len(m.heads), m.rank) for m in maps}) > 1:
            raise ValueError("lowrank: maps of different head counts or ranks do not fit one .npz; write the JSON")
        arrays.update(lowrank_layers=np.array([m.layer for m in maps], dtype=np.int64),
                      lowrank_heads=np.array([m.heads for m in maps], dtype=np.int64),
                      lowrank_rotation=np.array([m.rotation for m in maps], dtype=np.float64),
                      lowrank_source_weight=np.array([m.source_weight for m in maps], dtype=np.float64),
                      lowrank_source_bias=np.array([m.source_bias for m in maps], dtype=np.float64),
                      lowrank_alphas=np.array([m.alpha for m in maps], dtype=np.float64))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        np.savez(f, **arrays, fingerprint=np.array([fp.num_layers, fp.num_heads, fp.head_dim], dtype=np.int64),
                 scope=np.array(editing.scope), provenance=np.array(json.dumps(editing.provenance)))
    return path

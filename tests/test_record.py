"""The kernels' mask record and features (``kernels/record.py``): each accessor reads its own
field, absent tensors travel as 0, and the flat wrappers take exactly the record's fields and
the features."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch

from attnbias.kernels import record
from attnbias.kernels.forward import _attn_fwd
from attnbias.kernels.record import FEATURES, FIELDS, MaskFeatures, MaskRecord, flat_kernel

# features whose accessor is not named after the field (a host function has that name)
_FEATURE_ACCESSORS = {
    "alibi_sign": "alibi_sign_of",
    "tanh_mode": "tanh_mode_of",
    "page": "page_size",
}


def _index_read(accessor: object) -> int:
    """The position an accessor reads, from its source (``return M[i]`` or ``F[i]``)."""
    source = inspect.getsource(accessor.fn)  # type: ignore[attr-defined]
    found = re.findall(r"\b[MF]\[(\d+)\]", source)
    assert len(found) == 1, source
    return int(found[0])


def test_every_field_has_an_accessor_reading_its_position() -> None:
    """``mask_<field>(M)`` reads the field's position in :meth:`MaskRecord.values`: an
    accessor reading a neighbour's position (a field added in the middle without moving the
    ones after it) fails here."""
    for position, name in enumerate(FIELDS):
        accessor = getattr(record, f"mask_{name}")
        assert _index_read(accessor) == position, name


def test_every_feature_has_an_accessor_returning_it() -> None:
    """The feature accessors, evaluated on a features tuple of distinct values, return each
    its own feature."""
    values = tuple(f"value of {name}" for name in FEATURES)
    for name in FEATURES:
        accessor = getattr(record, _FEATURE_ACCESSORS.get(name, name))
        assert accessor.fn(values) == f"value of {name}", name


def test_accessors_are_exported_and_nothing_else_is_left_over() -> None:
    """Every accessor in the module is one of a field or a feature (no stale one survives a
    field's removal)."""
    expected = {f"mask_{name}" for name in FIELDS}
    expected |= {_FEATURE_ACCESSORS.get(name, name) for name in FEATURES}
    found = {
        name
        for name, value in vars(record).items()
        if hasattr(value, "fn") and not name.startswith("_") and name != "flat_kernel"
    }
    assert found == expected
    assert expected <= set(record.__all__)


def test_values_put_zero_for_absent_tensors_and_take_the_calls_pages() -> None:
    """Triton refuses a tuple holding ``None``: absent fields travel as 0; a launch's page
    table, lengths and ragged rows' first queries replace the record's own (the last three
    fields; the first queries as 0 where the launch has none)."""
    lo = torch.zeros(1, 4, dtype=torch.int32)
    made = MaskRecord(band_lo=-3, row_lo=lo, qk_scale=0.5, kv_pool=7)
    values = made.values()
    assert len(values) == len(FIELDS)
    by_name = dict(zip(FIELDS, values, strict=True))
    assert by_name["band_lo"] == -3 and by_name["row_lo"] is lo and by_name["kv_pool"] == 7
    assert by_name["row_hi"] == 0 and by_name["slopes"] == 0
    assert not any(value is None for value in values)
    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    paged = dict(zip(FIELDS, made.values(table, lens), strict=True))
    assert paged["page_table"] is table and paged["seq_lens"] is lens
    assert paged["query_starts"] == 0
    assert paged["row_lo"] is lo
    assert FIELDS[-3:] == ("page_table", "seq_lens", "query_starts")
    starts = torch.zeros(2, dtype=torch.int32)
    ragged = dict(zip(FIELDS, made.values(table, lens, starts), strict=True))
    assert ragged["query_starts"] is starts and ragged["seq_lens"] is lens


def test_features_options_name_every_feature_in_upper_case() -> None:
    """The flat wrappers' constexpr arguments are the features by their upper-case names."""
    features = MaskFeatures(has_lo=True, alibi_sign=-1, page=16)
    options = features.options()
    assert list(options) == [name.upper() for name in FEATURES]
    assert options["HAS_LO"] is True and options["ALIBI_SIGN"] == -1 and options["PAGE"] == 16
    assert [f.name for f in dataclasses.fields(MaskFeatures)] == list(FEATURES)


def test_flat_kernel_takes_the_fields_and_features_flat() -> None:
    """A kernel's flat form takes every field (``M_<field>``) where the kernel takes ``M``,
    every feature as a constexpr, and the kernel's other parameters as they are; made once."""
    flat = flat_kernel(_attn_fwd)
    assert flat_kernel(_attn_fwd) is flat
    names = list(inspect.signature(flat.fn).parameters)
    own = list(inspect.signature(_attn_fwd.fn).parameters)
    at = own.index("M")
    assert names[at : at + len(FIELDS)] == [f"M_{name}" for name in FIELDS]
    assert names[:at] == own[:at]
    for feature in FEATURES:
        assert feature.upper() in names
    assert "F" not in names and "M" not in names and "MOD" in names
    with_mods = flat_kernel(_attn_fwd, 2, {"MASK_FN": None, "SCORE_FN": None})
    names = list(inspect.signature(with_mods.fn).parameters)
    assert "MOD0" in names and "MOD1" in names and "MASK_FN" not in names


def test_flat_kernel_refuses_a_kernel_without_a_record() -> None:
    """A kernel taking no ``M`` / ``F`` has no flat form (a clear error, not a wrong one)."""
    from attnbias.kernels.decode_kernels import _decode_merge

    with pytest.raises(TypeError, match="no M parameter"):
        flat_kernel(_decode_merge)

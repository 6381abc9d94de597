"""DecodeStep and DecodeStep.build: every field takes ints (Python, numpy, or an integer array)
and nothing else; a value that does not fit its dtype, a float (even an integral one), a bool,
a string or a nested sequence is a ValueError / TypeError that names the field, before any
backend sees the step."""
import re

import numpy as np
import pytest

from zos import DecodeStep

FIELDS = ("req_ids", "new_rows", "new_tokens", "new_positions", "new_block_indptr",
          "new_block_ids", "append_rows", "append_block_ids", "rewrite_rows",
          "rewrite_block_indptr", "rewrite_block_ids")
I32_MIN, I32_MAX, I64_MIN, I64_MAX = -2**31, 2**31 - 1, -2**63, 2**63 - 1


def build_with(field, value):
    """DecodeStep.build of a valid step (rows 0 and 2 new, row 1 carried and growing, row 3
    carried with its block list rewritten) with ``value`` put into ``field``."""
    req_ids, appends = [10, 11, 12, 13], [(1, 4)]
    new = {0: (5, 3, [1, 2]), 2: (6, 0, [3])}
    rewrites = {3: [7, 8]}
    if field == "req_ids":
        req_ids = [10, value, 12]
    elif field == "new_rows":  # the bad key first: a key equal to it later keeps it
        new = {value: new[0], 2: new[2]}
    elif field == "new_tokens":
        new[2] = (value, 0, [3])
    elif field == "new_positions":
        new[2] = (6, value, [3])
    elif field == "new_block_ids":
        new[2] = (6, 0, [3, value])
    elif field == "append_rows":
        appends = [(value, 4)]
    elif field == "append_block_ids":
        appends = [(1, value)]
    elif field == "rewrite_rows":  # the bad key first, as for new_rows
        rewrites = {value: rewrites[3]}
    elif field == "rewrite_block_ids":
        rewrites = {3: [7, value]}
    return DecodeStep.build(req_ids, new, appends, rewrites)


BUILD_FIELDS = [f for f in FIELDS if not f.endswith("_indptr")]  # build computes the indptrs


def _out_of_range(field):
    if field == "req_ids":
        return [I64_MAX + 1, I64_MIN - 1, 2**64, np.uint64(2**63)]
    return [I32_MAX + 1, I32_MIN - 1, 2**63, 10**30, np.int64(2**40)]


OUT_OF_RANGE = [(f, v) for f in BUILD_FIELDS for v in _out_of_range(f)]
WRONG_TYPE = [1.5, 2.0, np.float64(1.0), np.float32(3.0), True, np.bool_(False), "3", b"3",
              None, [1], (1,), {1: 2}, 1 + 0j]


def _names(message, field, value):
    """The message names the field and shows the value."""
    return field in message and (repr(value) in message or str(value) in message)


def test_build_valid_step_exact():
    """The reference case: numpy ints, a range and an array for block ids, keys out of order;
    the boundaries of int32 / int64 are values, not errors."""
    step = DecodeStep.build(np.array([7, I64_MAX, I64_MIN], np.int64),
                            {2: (np.int32(I32_MAX), 0, range(8, 10)),
                             0: (4, I32_MAX, np.array([I32_MAX], np.int64))},
                            [(1, I32_MIN), (np.int64(1), 6)],
                            {np.int64(1): np.array([3, I32_MAX], np.int64), 0: range(2)})
    got = {f: (getattr(step, f).dtype, getattr(step, f).tolist()) for f in FIELDS}
    i32 = np.dtype(np.int32)
    assert got == {"req_ids": (np.dtype(np.int64), [7, I64_MAX, I64_MIN]),
                   "new_rows": (i32, [0, 2]), "new_tokens": (i32, [4, I32_MAX]),
                   "new_positions": (i32, [I32_MAX, 0]), "new_block_indptr": (i32, [0, 1, 3]),
                   "new_block_ids": (i32, [I32_MAX, 8, 9]), "append_rows": (i32, [1, 1]),
                   "append_block_ids": (i32, [I32_MIN, 6]), "rewrite_rows": (i32, [0, 1]),
                   "rewrite_block_indptr": (i32, [0, 2, 4]),
                   "rewrite_block_ids": (i32, [0, 1, 3, I32_MAX])}
    assert step.num_reqs == 3
    empty = DecodeStep.build([])
    assert [getattr(empty, f).tolist() for f in FIELDS] == [[], [], [], [], [0], [], [], [], [],
                                                            [0], []]


def test_build_reported_cases():
    """The two cases of the report: 2**63 was numpy's OverflowError, 1.5 became 1."""
    with pytest.raises(ValueError, match=r"req_ids\[0\] = 9223372036854775808 does not fit int64"):
        DecodeStep.build([2**63])
    with pytest.raises(TypeError, match=r"new_tokens of new row 0 must be an int, got float 1\.5"):
        DecodeStep.build([1], {0: (1.5, 0, [1])})


@pytest.mark.parametrize("field,value", OUT_OF_RANGE,
                         ids=[f"{f}-{v!r}" for f, v in OUT_OF_RANGE])
def test_build_out_of_range(field, value):
    with pytest.raises(ValueError) as err:
        build_with(field, value)
    assert _names(str(err.value), field, value), str(err.value)
    assert "does not fit int" in str(err.value)


@pytest.mark.parametrize("field", BUILD_FIELDS)
@pytest.mark.parametrize("value", WRONG_TYPE, ids=repr)
def test_build_wrong_type(field, value):
    if field in ("new_rows", "rewrite_rows") and isinstance(value, (list, dict)):  # a dict key
        value = tuple(value) if isinstance(value, list) else frozenset(value)
    with pytest.raises(TypeError) as err:
        build_with(field, value)
    assert _names(str(err.value), field, value), str(err.value)


@pytest.mark.parametrize("field", BUILD_FIELDS)
def test_build_in_range_values_pass(field):
    """The same slots hold the largest value of their dtype exactly (the checks above are not
    stricter than the dtype)."""
    top = I64_MAX if field == "req_ids" else I32_MAX
    step = build_with(field, top)
    assert top in getattr(step, field).tolist()


@pytest.mark.parametrize("bad,match", [
    (5, r"new_block_ids of new row 0 must be a sequence of ints, got int 5"),
    ("12", r"new_block_ids of new row 0 must be a sequence of ints, got str '12'"),
    ([[1, 2]], r"new_block_ids\[0\] of new row 0 must be an int, got list \[1, 2\]"),
    (np.array([1.0]), r"new_block_ids\[0\] of new row 0 must be an int, got float64"),
])
def test_build_block_ids_not_ints(bad, match):
    with pytest.raises(TypeError, match=match):
        DecodeStep.build([1], {0: (1, 0, bad)})


@pytest.mark.parametrize("args,exc,match", [
    (([1], [(0, 1, [1])]), TypeError, r"new must be a mapping"),
    (([1], {0: (1, 0)}), TypeError,
     r"new\[0\] must be \(token, position, block_ids\), got \(1, 0\)"),
    (([1], {0: 7}), TypeError, r"new\[0\] must be \(token, position, block_ids\), got 7"),
    (([1], None, 5), TypeError, r"appends must be an iterable of \(row, block_id\) pairs"),
    (([1], None, [(0, 1, 2)]), TypeError,
     r"appends\[0\] must be a \(row, block_id\) pair, got \(0, 1, 2\)"),
    (([1], None, [3]), TypeError, r"appends\[0\] must be a \(row, block_id\) pair, got 3"),
    (([1], None, (), [(0, [1])]), TypeError, r"rewrites must be a mapping \{row: block_ids\}"),
    (([1], None, (), {0: 5}), TypeError,
     r"rewrite_block_ids of rewritten row 0 must be a sequence of ints, got int 5"),
    (([1], None, (), {0: [[1]]}), TypeError,
     r"rewrite_block_ids\[0\] of rewritten row 0 must be an int, got list \[1\]"),
    ((7,), TypeError, r"req_ids must be a sequence of ints, got int 7"),
    (("123",), TypeError, r"req_ids must be a sequence of ints, got str '123'"),
    ((np.array([1.0, 2.0]),), TypeError,
     r"req_ids must hold integers, got an array of dtype float64"),
    ((np.array([[1, 2]]),), ValueError, r"req_ids must be 1-D, got shape \(1, 2\)"),
])
def test_build_argument_shapes(args, exc, match):
    with pytest.raises(exc, match=match):
        DecodeStep.build(*args)


def _valid_fields():
    return dict(req_ids=[10, 11], new_rows=[1], new_tokens=[5], new_positions=[0],
                new_block_indptr=[0, 1], new_block_ids=[3], append_rows=[0],
                append_block_ids=[4], rewrite_rows=[0], rewrite_block_indptr=[0, 2],
                rewrite_block_ids=[5, 6])


def _lo_hi(field):
    return (I64_MIN, I64_MAX) if field == "req_ids" else (I32_MIN, I32_MAX)


@pytest.mark.parametrize("field", FIELDS)
def test_constructor_exact_and_boundaries(field):
    kw = _valid_fields()
    lo, hi = _lo_hi(field)
    kw[field] = kw[field] + [lo, hi]
    step = DecodeStep(**kw)
    assert getattr(step, field).tolist() == kw[field]
    assert getattr(step, field).dtype == (np.int64 if field == "req_ids" else np.int32)
    as_array = DecodeStep(**{**kw, field: np.array(kw[field], np.int64)})
    assert getattr(as_array, field).tolist() == kw[field]


CTOR_RANGE = [(f, w) for f in FIELDS for w in ("above", "below", "array above", "array below")
              if (f, w) != ("req_ids", "array below")]  # no integer dtype goes below int64


@pytest.mark.parametrize("field,which", CTOR_RANGE)
def test_constructor_out_of_range(field, which):
    kw = _valid_fields()
    lo, hi = _lo_hi(field)
    value = hi + 1 if "above" in which else lo - 1
    kw[field] = kw[field] + [value]
    if "array" in which:  # past int64 above: a uint64 array
        kw[field] = np.array(kw[field], np.uint64 if field == "req_ids" else np.int64)
    with pytest.raises(ValueError) as err:
        DecodeStep(**kw)
    assert _names(str(err.value), field, value), str(err.value)


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("value", WRONG_TYPE, ids=repr)
def test_constructor_wrong_type(field, value):
    kw = _valid_fields()
    kw[field] = kw[field] + [value]
    with pytest.raises(TypeError) as err:
        DecodeStep(**kw)
    assert _names(str(err.value), field, value), str(err.value)


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("array,exc,match", [
    (np.array([1.5]), TypeError, "must hold integers, got an array of dtype float64"),
    (np.array([2.0], np.float32), TypeError, "must hold integers, got an array of dtype float32"),
    (np.zeros(0), TypeError, "must hold integers, got an array of dtype float64"),
    (np.array([True]), TypeError, "must hold integers, got an array of dtype bool"),
    (np.array(["1"]), TypeError, "must hold integers, got an array of dtype <U1"),
    (np.array([1], object), TypeError, "must hold integers, got an array of dtype object"),
    (np.zeros((1, 1), np.int32), ValueError, r"must be 1-D, got shape \(1, 1\)"),
    (np.int64(3), ValueError, r"must be 1-D, got shape \(\)"),
    (7, TypeError, "must be a sequence of ints, got int 7"),
    ("7", TypeError, "must be a sequence of ints, got str '7'"),
], ids=["float", "float32", "empty-float", "bool", "unicode", "object", "2d", "0d", "int",
        "str"])
def test_constructor_arrays_and_scalars(field, array, exc, match):
    with pytest.raises(exc, match=rf"^{re.escape(field)} {match}"):
        DecodeStep(**{**_valid_fields(), field: array})


def test_constructor_messages_kept():
    """The messages of the former test_backends.test_decode_step_type_errors."""
    with pytest.raises(TypeError, match="req_ids must hold integers"):
        DecodeStep(req_ids=np.array([1.5]))
    with pytest.raises(ValueError, match="new_rows must be 1-D"):
        DecodeStep(req_ids=[1], new_rows=np.zeros((1, 1), np.int32))
    with pytest.raises(ValueError, match=r"new_tokens\[0\] = 1099511627776 does not fit int32"):
        DecodeStep(req_ids=[1], new_tokens=[2**40])

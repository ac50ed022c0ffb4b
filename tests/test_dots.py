"""cassmail.dots against the plain bytes operations it stands in for, on data below and above
VECTOR_MIN (where numpy takes over): random lines with dots, CRs and LFs in every place."""

from __future__ import annotations

import mmap
import random

import pytest

from cassmail import dots
from cassmail.smtp.spool import _unstuff


def _mail(rng: random.Random, size: int) -> bytes:
    """Lines of 0-80 bytes drawn mostly from a few bytes that matter here, with CRLF, bare LF and
    bare CR endings: every kind of neighbour a dot can have."""
    out = bytearray()
    while len(out) < size:
        out += bytes(rng.choice(b"..\r\n\nab") for _ in range(rng.randint(0, 80)))
        out += rng.choice([b"\r\n", b"\r\n", b"\n", b"\r"])
    return bytes(out[:size])


SIZES = [0, 1, 2, 5, 100, dots.VECTOR_MIN - 1, dots.VECTOR_MIN, dots.VECTOR_MIN + 3, 3 * dots.VECTOR_MIN + 7]


@pytest.mark.parametrize("size", SIZES)
def test_dots_are_found_doubled_and_dropped_as_the_bytes_operations_would(size: int) -> None:
    rng = random.Random(size)
    for _ in range(20):
        data = _mail(rng, size)
        for at_line_start in (True, False):
            want = data.replace(b"\n.", b"\n..")
            if at_line_start and data.startswith(b"."):
                want = b"." + want
            assert dots.stuff(data, at_line_start) == want
        assert dots.unstuff(bytearray(data)) == data.replace(b"\r\n.", b"\r\n")
        start = rng.randint(0, max(0, size - 1))
        assert dots.find_end_of_data(bytearray(data), start) == data.find(dots.END_OF_DATA, start)
        want_dots = [i + 2 for i in range(len(data)) if data.startswith(b"\r\n.", i) and i + 2 >= start]
        assert dots.line_dots(data, b"\r\n", start=start) == want_dots


def test_a_bytearray_grows_again_after_being_looked_at() -> None:
    buf = bytearray(_mail(random.Random(1), 4 * dots.VECTOR_MIN).replace(b".", b","))
    dots.line_dots(buf)
    dots.find_end_of_data(buf)
    buf += b"\r\n.\r\n"  # no numpy view of it is left behind
    assert dots.find_end_of_data(buf) == len(buf) - 5


@pytest.mark.parametrize("size", [10, 5 * dots.VECTOR_MIN])
def test_a_spool_files_mapping_is_unstuffed_in_place(size: int) -> None:
    data = b"\r\n" + _mail(random.Random(size), size)
    with mmap.mmap(-1, len(data) + 10) as mapping:
        mapping[5 : 5 + len(data)] = data
        end = _unstuff(mapping, 5, 5 + len(data))
        assert mapping[5:end] == data.replace(b"\r\n.", b"\r\n")

import pytest

from api.priority import parse_priority

MISSING = object()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (5, 5),
        (MISSING, 0),
        (None, 0),
        ("5", 0),
        (5.0, 0),
        (True, 0),
        (False, 0),
        (10**40, 100),
        (-3, -3),
        (-(10**40), -100),
        ([5], 0),
        ({"p": 5}, 0),
    ],
)
def test_priority_table(raw, expected):
    body = {} if raw is MISSING else {"priority": raw}
    assert parse_priority(body.get("priority"), -100, 100) == expected


def test_zero_is_clamped_into_a_range_that_excludes_it():
    assert parse_priority("x", 1, 10) == 1

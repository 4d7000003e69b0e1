"""gpud.errors: the one exception tree and the one code/errno table."""

from __future__ import annotations

import errno

import pytest

from gpud import errors
from gpud.errors import CODES, ERRNO, GpudError, error_for


@pytest.mark.parametrize("code", list(CODES))
def test_code_maps_to_class_with_that_code(code: str) -> None:
    cls, num = CODES[code]
    assert issubclass(cls, GpudError)
    assert cls.code == code
    exc = cls("boom")
    assert exc.code == code and exc.errno == num == ERRNO[code]


@pytest.mark.parametrize("code", list(CODES))
def test_error_for_round_trip(code: str) -> None:
    exc = error_for(code, "something went wrong")
    assert type(exc) is CODES[code][0]
    assert exc.code == code
    assert exc.message == "something went wrong"
    assert exc.errno == CODES[code][1]
    again = error_for(exc.code, exc.message)
    assert (type(again), again.code, again.message) == (type(exc), exc.code, exc.message)


def test_unknown_code() -> None:
    exc = error_for("NO_SUCH_CODE", "odd")
    assert type(exc) is GpudError
    assert exc.code == "NO_SUCH_CODE"
    assert "odd" in exc.message and "NO_SUCH_CODE" in exc.message
    assert exc.errno == errno.EIO
    assert GpudError.code == "INTERNAL"  # the instance code did not leak into the class


def test_all_exception_classes_subclass_gpud_error() -> None:
    classes = [
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type)
        and issubclass(obj, BaseException)
        and obj.__module__ == errors.__name__
    ]
    assert len(classes) >= len(CODES) + 1
    for cls in classes:
        assert issubclass(cls, GpudError), cls
        assert isinstance(cls.code, str)
    for cls in (errors.ProtocolError, errors.AuthError, errors.ConfigError, errors.ConflictError):
        assert issubclass(cls, GpudError)
    for cls in (errors.VersionError, errors.UnknownCommand, errors.TooLarge):
        assert issubclass(cls, errors.ProtocolError)


def test_no_two_codes_share_an_errno() -> None:
    nums = [num for _, num in CODES.values()]
    assert len(set(nums)) == len(nums)
    classes = [cls for cls, _ in CODES.values()]
    assert len(set(classes)) == len(classes)


def test_message_defaults_to_class_name() -> None:
    assert errors.Busy().message == "Busy"
    assert errors.Busy("full").message == "full"
    assert str(errors.Busy("full")) == "full"

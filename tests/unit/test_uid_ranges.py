"""UidBlocks refuses a range in which no block fits, naming the largest base that would."""

import pytest

from gpud.errors import ConfigError
from gpud_cli.uid_ranges import DYNAMIC_LAST, UidBlocks


def test_a_base_past_the_range_is_refused_at_once(tmp_path):
    with pytest.raises(ConfigError, match=f"choose a base of at most {DYNAMIC_LAST - 15}"):
        UidBlocks(DYNAMIC_LAST, 16, DYNAMIC_LAST, str(tmp_path))


def test_the_last_block_that_fits_is_handed_out(tmp_path):
    blocks = UidBlocks(DYNAMIC_LAST - 15, 16, DYNAMIC_LAST, str(tmp_path))
    assert blocks.take() == range(DYNAMIC_LAST - 15, DYNAMIC_LAST + 1)
    blocks.close()

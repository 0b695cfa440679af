"""A module that reads its environment when imported, as a test module's ``skipif(torch.cuda...)`` does."""

from __future__ import annotations

import os

AT_IMPORT = os.environ.get("COMMLIB_TEST_AT_IMPORT")


def seen_at_import() -> str | None:
    """What ``COMMLIB_TEST_AT_IMPORT`` was when this module was imported in this process."""
    return AT_IMPORT

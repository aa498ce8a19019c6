"""The one way a test module asks for verl: a skip where verl is not installed, a failure in CI's
verl venv (`FGRPO_REQUIRE_VERL=1`, see .ci/run), where a skip would hide a broken install."""

import importlib
import os

import pytest


def need_verl():
    if os.environ.get("FGRPO_REQUIRE_VERL"):
        return importlib.import_module("verl")
    return pytest.importorskip("verl")

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from tests.tiny_models import build_all

    return build_all(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    from tests.tiny_models import build_families

    return build_families(tmp_path_factory.mktemp("family_models"))

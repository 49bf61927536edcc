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


# The suite runs two test files at a time (pytest.ini: `-n 2 --dist loadfile`; most tests keep
# one core busy: tiny models and process start-up). Files are handed out in collection order
# (`--no-loadscope-reorder`: xdist would otherwise hand out the files with most tests first, and
# the two single-test acceptance runs, 11 minutes together, ended the run on one worker while
# the other idled), so the longest go first and the short ones fill in around them
# (docs/testing.md has the times).
LONGEST_FIRST = ("test_rm_accuracy.py", "test_demo.py", "test_slurm_two_nodes.py", "test_ppo.py",
                 "test_interrupted_runs.py", "test_multi_agent.py", "test_moe_training.py",
                 "test_train_rm.py", "test_sft.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))

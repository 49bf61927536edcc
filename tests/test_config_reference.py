"""docs/config.md: every key of the typed config tree, generated from its field docstrings."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_rlhf.config.reference import COMMANDS, reference, rows

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def _configs():
    from megatron_rlhf.config import ppo_schema, schema

    return {command: getattr(schema, name, None) or getattr(ppo_schema, name)
            for command, name in COMMANDS}


def test_docs_config_md_is_the_generated_reference():
    assert DOC.read_text() == reference(), (
        "docs/config.md is stale: run `python -m megatron_rlhf.config.reference > docs/config.md`")


def test_every_key_is_documented_and_batch_sizes_name_unit_and_scope():
    for command, cls in _configs().items():
        table = rows(cls)
        assert len(table) > 30
        undocumented = [key for key, _, _, doc in table if not doc]
        assert not undocumented, f"{command}: keys without a docstring: {undocumented}"
        for key, _, _, doc in table:
            leaf = key.rsplit(".", 1)[-1]
            if "batch_size" in leaf or leaf.endswith("_tokens_per_rank"):
                assert re.search(r"\b(prompts?|samples?|examples?|pairs?|tokens?)\b", doc, re.I), key
                assert re.search(r"global|per data-parallel rank|on one data-parallel rank", doc), key
            if leaf.endswith("_length"):
                assert "token" in doc.lower(), key


def test_nested_sections_and_lists_are_walked():
    keys = {key for key, *_ in rows(_configs()["megatron-rlhf ppo"])}
    assert {"actor.optim.lr", "actor.offload.params", "actor.router_replay",
            "algorithm.rollout_correction.tis_cap", "critic.parallel", "critic.parallel.tp",
            "agents[].name"} <= keys

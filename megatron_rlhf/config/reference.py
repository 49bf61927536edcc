"""The configuration reference (``docs/config.md``), generated from the typed config tree.

Every key of ``train-rm``, ``sft`` and ``ppo`` with its type, default and the field's docstring
(which names its unit and scope), read from the dataclasses' source: the docstrings under the
fields are the documentation, so the reference cannot drift from the code.
``python -m megatron_rlhf.config.reference > docs/config.md`` rewrites it; a test fails when
the committed file is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from functools import lru_cache

HEADER = """# Configuration reference

Generated from the typed config tree (`megatron_rlhf/config/schema.py`,
`megatron_rlhf/config/ppo_schema.py`) by `python -m megatron_rlhf.config.reference > docs/config.md`;
`tests/test_config_reference.py` fails when this file is stale. Set any key in the YAML file
given to `--config`, or on the command line as `key=value` (`actor.optim.lr=1e-6`,
`data.train_files=[a.parquet,b.parquet]`). Batch sizes name their unit (prompts, samples, pairs,
tokens) and scope (global, or per data-parallel rank) in their description. Values are
validated once at start-up; a bad one stops the run with an error naming the key.
"""

COMMANDS = (("megatron-rlhf train-rm", "RMConfig"), ("megatron-rlhf sft", "SFTConfig"),
            ("megatron-rlhf ppo", "PPOConfig"))


@lru_cache(maxsize=None)
def field_docs(cls) -> dict[str, str]:
    """Field name -> the docstring written under it, over ``cls`` and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, after in zip(body, body[1:] + [None]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _nested(hint) -> type | None:
    """The dataclass a field holds (``X``, ``Optional[X]``), or None."""
    if dataclasses.is_dataclass(hint):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _list_of(hint) -> type | None:
    """The dataclass of a ``list[X]`` field, or None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _type_name(hint) -> str:
    if hint is type(None):
        return "null"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return " \\| ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(hint, "__name__", str(hint))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value == "???":
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value!r}`" if not isinstance(value, str) else f"`{value}`" if value else '`""`'


def rows(cls, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) of every leaf key under ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        key, hint = prefix + f.name, hints[f.name]
        nested, items = _nested(hint), _list_of(hint)
        if nested is not None:
            if _default(f) == "null" and docs.get(f.name):
                out.append((key, _type_name(hint), "null", docs[f.name]))
            out += rows(nested, key + ".")
        elif items is not None:
            out.append((key, f"list[{items.__name__}]", _default(f), docs.get(f.name, "")))
            out += rows(items, key + "[].")
        else:
            out.append((key, _type_name(hint), _default(f), docs.get(f.name, "")))
    return out


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def reference() -> str:
    from megatron_rlhf.config import ppo_schema, schema

    parts = [HEADER]
    for command, name in COMMANDS:
        cls = getattr(schema, name, None) or getattr(ppo_schema, name)
        parts.append(f"\n## `{command}`\n\n| key | type | default | description |\n|---|---|---|---|")
        for key, kind, default, doc in rows(cls):
            parts.append(f"| `{key}` | {kind} | {_escape(default)} | {_escape(doc)} |")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(reference(), end="")

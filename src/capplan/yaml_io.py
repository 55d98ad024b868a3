"""Reading untrusted YAML safely, and writing files atomically.

Specs and plans arrive through pull requests, so loading is fail-closed: the
safe loader only (no tags, no Python objects), duplicate keys rejected,
size, depth and list-length limits enforced before validation.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml

from capplan.errors import CapplanError
from capplan.limits import MAX_DEPTH, MAX_FILE_BYTES, MAX_ITEMS


# libyaml's parser with PyYAML's safe constructor when available (plans of
# thousands of lines load ~10x faster); the pure-Python SafeLoader otherwise.
_SafeBase = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_SafeBase):
    """Safe loader that rejects duplicate mapping keys instead of keeping the last."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    loader.flatten_mapping(node)
    mapping = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "mapping key is not a scalar", key_node.start_mark
            ) from None
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


def safe_load(text: str) -> object:
    """One YAML document with the safe, duplicate-rejecting loader (raises yaml.YAMLError)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - SafeLoader subclass


def check_shape(value: object, what: str, depth: int = 0) -> int:
    """Entries in `value`; CapplanError past MAX_DEPTH levels or MAX_ITEMS entries (the loader's limits)."""
    if depth > MAX_DEPTH:
        raise CapplanError(f"{what}: nested deeper than {MAX_DEPTH} levels", "flatten the file")
    items = 0
    if isinstance(value, dict):
        for v in value.values():
            items += 1 + check_shape(v, what, depth + 1)
    elif isinstance(value, list):
        for v in value:
            items += 1 + check_shape(v, what, depth + 1)
    if items > MAX_ITEMS:
        raise CapplanError(f"{what}: more than {MAX_ITEMS} entries", "this is not a capplan file")
    return items


def read_yaml(path: Path, what: str, error: type[CapplanError]) -> object:
    """Load one YAML document from `path`; every failure is a one-line `error`."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    if path.is_dir():
        raise error(f"{path}: is a directory, expected a {what} file")
    if size > MAX_FILE_BYTES:
        raise error(f"{path}: {size} bytes is larger than the {MAX_FILE_BYTES} byte limit for a {what}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise error(f"{path}{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: invalid YAML ({str(exc).splitlines()[0]})") from None
    except RecursionError:
        raise error(f"{path}: nested too deeply") from None
    try:
        check_shape(data, str(path))
    except CapplanError as exc:
        raise error(exc.message, exc.hint) from None
    return data


def write_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same folder and rename: readers see old or new, never half."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise

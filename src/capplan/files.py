"""Every file capplan reads or writes goes through here.

Specs, plans and traces arrive through pull requests and from other people's
machines, so reading fails closed, with one line naming the user's path:

- regular files only (a FIFO would hang, /dev/zero would never end), read
  with a byte limit counted while reading, then strictly UTF-8;
- YAML with the safe loader and YAML 1.2 scalars: `yes`, `on`, `0256`,
  `1:00` and dates are not silently turned into booleans, octal or
  sexagesimal numbers or timestamps; octal- and sexagesimal-looking values
  and integers of more than MAX_INT_DIGITS digits are refused with a message,
  duplicate keys are refused, depth and entry counts are bounded;
- JSON lines with a per-line limit, duplicate keys refused, no NaN or
  Infinity, integers bounded.

Writing is atomic (a temp file in the target's folder, then rename), keeps
the target's permissions (a new file gets 0666 minus the umask, 0644 usually),
refuses to overwrite one of the command's inputs, to write through a symbolic
link or onto anything but a regular file, and removes its temp file on
SIGTERM or Ctrl-C; a temp file left by a killed process is hidden (a dot
name) and swept on the next write to the same target.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TextIO

import yaml

from capplan.errors import CapplanError, printable
from capplan.limits import MAX_DEPTH, MAX_FILE_BYTES, MAX_INT_DIGITS, MAX_ITEMS, MAX_LINE_BYTES


def shown(path: Path | str) -> str:
    """A path as it goes into a one-line message."""
    return printable(str(path))


# --- reading ------------------------------------------------------------------


def read_text(path: Path, what: str, error: type[CapplanError], limit: int = MAX_FILE_BYTES) -> str:
    """The whole text of a regular file, at most `limit` bytes; every failure is one `error` line."""
    name = shown(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{name}: no such file") from None
    except OSError as exc:
        raise error(f"{name}: cannot read ({exc.strerror})") from None
    except ValueError:  # a NUL byte in the name: no file system has such a file
        raise error(f"{name}: no such file (the name holds a NUL byte)") from None
    if stat.S_ISDIR(info.st_mode):
        raise error(f"{name}: is a directory, expected a {what.removesuffix(' file')} file")
    if not stat.S_ISREG(info.st_mode):
        raise error(
            f"{name}: not a regular file (a device, pipe or socket), expected a {what.removesuffix(' file')} file"
        )
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise error(f"{name}: cannot read ({exc.strerror})") from None
    if len(data) > limit:
        raise error(f"{name}: larger than the {limit} byte limit for a {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{name}: not UTF-8 text") from None


# YAML 1.2 core schema scalars, and the YAML 1.1 forms PyYAML would read as
# something else, refused with a message instead of silently converted.
_INT = re.compile(r"^[-+]?[0-9]+$")
_FLOAT = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$")
_SUSPECT = re.compile(
    r"^(?:[-+]?0[0-9_]+"  # 0256: octal in YAML 1.1
    r"|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?"  # 1:00: sexagesimal in YAML 1.1
    r"|[-+]?0[xob][0-9a-fA-F_]+"  # hex, octal, binary literals
    r"|[-+]?[0-9][0-9_]*_[0-9_]*(?:\.[0-9_]*)?)$"  # 1_000
)
_SUSPECT_TAG = "tag:capplan,2026:suspect-number"


_SafeLoader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser when present


class _Loader(_SafeLoader):  # type: ignore[misc, valid-type]
    """Safe loader: YAML 1.2 scalars, duplicate keys and suspicious numbers refused."""


_Loader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in [
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:int", _INT.pattern, "-+0123456789"),
    ("tag:yaml.org,2002:float", _FLOAT.pattern, "-+.0123456789"),
    ("tag:yaml.org,2002:float", r"^(?:[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", "-+."),
    (_SUSPECT_TAG, _SUSPECT.pattern, "-+0123456789"),
]:
    _Loader.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))


def _problem(node: yaml.Node, message: str) -> yaml.constructor.ConstructorError:
    return yaml.constructor.ConstructorError(None, None, message, node.start_mark)


def _int_value(text: str) -> int:
    """A YAML int scalar's value (ValueError: what is wrong with it)."""
    if len(text.lstrip("+-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    if len(text.lstrip("+-")) > 1 and text.lstrip("+-").startswith("0"):
        raise ValueError(f"{text} has a leading zero (YAML 1.1 reads it as octal); write {int(text)}")
    return int(text)


def _float_value(text: str) -> float:
    """A YAML float scalar's value (ValueError: what is wrong with it)."""
    if len(text) > 64:
        raise ValueError(f"number of {len(text)} characters (at most 64)")
    lowered = text.lower()
    if lowered.endswith(("inf", "nan")):
        return float(lowered.replace(".", ""))
    return float(text)


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    try:
        return _int_value(loader.construct_scalar(node))
    except ValueError as exc:
        raise _problem(node, str(exc)) from None


def _construct_float(loader: _Loader, node: yaml.ScalarNode) -> float:
    try:
        return _float_value(loader.construct_scalar(node))
    except ValueError as exc:
        raise _problem(node, str(exc)) from None


def _construct_suspect(loader: _Loader, node: yaml.ScalarNode) -> None:
    text = loader.construct_scalar(node)
    raise _problem(
        node,
        f"{text[:40]} is ambiguous (YAML 1.1 reads it as an octal, hex, binary or "
        "base-60 number); write a plain decimal number, or quote it if it is a string",
    )


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    mapping = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise _problem(key_node, "mapping key is not a scalar") from None
        if key in mapping:
            raise _problem(key_node, f"duplicate key {printable(repr(key))[:60]}")
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)
_Loader.add_constructor(_SUSPECT_TAG, _construct_suspect)
_Loader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)


def _node_bound(text: str) -> int:
    """An upper bound on the YAML nodes in `text`, counted without parsing: every node but
    the first follows a line break, a comma, a bracket, a colon or a dash."""
    return sum(text.count(c) for c in "\n,[{:-") + 1


def _too_many_nodes(text: str) -> bool:
    """Whether the document holds more entries than any capplan file may, decided while
    parsing (the parser's events, no document built), so a small file of very many nodes is
    refused in a fraction of the time building it would take. A document of more than
    2 * MAX_ITEMS + 1 nodes has more than MAX_ITEMS entries (a mapping entry is two nodes)."""
    limit = 2 * MAX_ITEMS + 1
    if _node_bound(text) <= limit:
        return False
    nodes = 0
    for event in yaml.parse(text, Loader=_SafeLoader):
        if isinstance(event, (yaml.ScalarEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent, yaml.AliasEvent)):
            nodes += 1
            if nodes > limit:
                return True
    return False


def safe_load(text: str) -> object:
    """One YAML document (raises yaml.YAMLError; CapplanError past MAX_ITEMS entries)."""
    if _too_many_nodes(text):
        raise CapplanError(f"more than {MAX_ITEMS} entries", "this is not a capplan file")
    plain, data = _plain_document(text)
    if plain:
        return data
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


class _NotPlain(Exception):
    """The document has something only the full loader reads (or refuses) as it should."""


_SCALARS: dict[str, Callable[[str], object]] = {
    "tag:yaml.org,2002:str": str,
    "tag:yaml.org,2002:null": lambda text: None,
    "tag:yaml.org,2002:bool": lambda text: text.lower() == "true",
    "tag:yaml.org,2002:int": _int_value,
    "tag:yaml.org,2002:float": _float_value,
}


def _plain_document(text: str) -> tuple[bool, object]:
    """(True, the document) when `text` is one plain YAML document (no tags, anchors or
    aliases; scalar keys, none twice; every scalar one the loader reads without a problem),
    built straight from libyaml's events, with the loader's own resolver and scalar rules;
    (False, None) for anything else, which the full loader then reads or refuses with its
    own message. The plan files capplan writes are plain: building them this way skips
    PyYAML's composer, about 3 s of the 5 s a 2 MB plan took to load."""
    loader = _Loader(text)
    # open containers, each with the key waiting for its value (_NotPlain: none waits)
    stack: list[tuple[list | dict, object]] = []
    done: list[object] = []

    def add(value: object) -> None:
        if not stack:
            done.append(value)
            return
        container, key = stack[-1]
        if isinstance(container, list):
            container.append(value)
        elif key is _NotPlain:
            if isinstance(value, (list, dict)) or value in container:
                raise _NotPlain  # a collection as a key, or a key given twice
            stack[-1] = (container, value)
        else:
            container[key] = value  # type: ignore[index]
            stack[-1] = (container, _NotPlain)

    try:
        events = 0
        while loader.check_event():
            event = loader.get_event()
            events += 1
            kind = type(event)
            if kind is yaml.ScalarEvent:
                if event.anchor is not None or event.tag is not None:
                    raise _NotPlain
                tag = loader.resolve(yaml.ScalarNode, event.value, event.implicit)
                if tag not in _SCALARS:
                    raise _NotPlain  # the suspect numbers, refused with the loader's message
                add(_SCALARS[tag](event.value))
            elif kind in (yaml.MappingStartEvent, yaml.SequenceStartEvent):
                if event.anchor is not None or event.tag is not None or len(stack) > 64:
                    raise _NotPlain
                stack.append(({} if kind is yaml.MappingStartEvent else [], _NotPlain))
            elif kind in (yaml.MappingEndEvent, yaml.SequenceEndEvent):
                container, _ = stack.pop()
                add(container)
            elif kind is yaml.AliasEvent:
                raise _NotPlain
    except (_NotPlain, ValueError, yaml.YAMLError):
        return False, None
    finally:
        loader.dispose()
    if len(done) != 1 or events < 4:  # several documents, or none: the loader says which
        return False, None
    return True, done[0]


def check_shape(value: object, what: str, depth: int = 0) -> int:
    """Entries in `value`; CapplanError past MAX_DEPTH levels or MAX_ITEMS entries."""
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
    """One YAML document from a regular file; every failure is a one-line `error`."""
    text = read_text(path, what, error)
    name = shown(path)
    try:
        data = safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise error(f"{name}{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise error(f"{name}: invalid YAML ({str(exc).splitlines()[0]})") from None
    except RecursionError:
        raise error(f"{name}: nested too deeply") from None
    except CapplanError as exc:
        raise error(f"{name}: {exc.message}", exc.hint) from None
    try:
        check_shape(data, name)
    except CapplanError as exc:
        raise error(exc.message, exc.hint) from None
    return data


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _no_constants(text: str) -> None:
    raise ValueError(f"{text} is not a number JSON allows")


def _unique(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {printable(key)[:40]!r}")
        out[key] = value
    return out


def json_value(line: str) -> object:
    """One JSON value: duplicate keys, NaN/Infinity, huge integers and nesting past MAX_DEPTH
    refused (ValueError)."""
    if line.count("[") + line.count("{") > MAX_DEPTH and json_depth(line) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    try:
        # the digit check runs in C; only a line with a long run of digits pays for the checking decoder
        decoder = _JSON_CHECKED if _LONG_DIGITS.search(line) else _JSON
        return decoder.decode(line)
    except RecursionError:
        raise ValueError("nested too deeply") from None


_LONG_DIGITS = re.compile(f"[0-9]{{{MAX_INT_DIGITS + 1}}}")
_JSON = json.JSONDecoder(object_pairs_hook=_unique, parse_constant=_no_constants)
_JSON_CHECKED = json.JSONDecoder(object_pairs_hook=_unique, parse_int=_bounded_int, parse_constant=_no_constants)


def json_depth(line: str) -> int:
    """The deepest bracket nesting of a JSON text (brackets inside strings not counted)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in line:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


# A line with something on it that is not a `#` comment (the regex engine skips the rest,
# so a file of blank or comment lines costs neither a Python loop nor a list of lines).
_CONTENT_LINE = re.compile(r"^[^\S\n]*[^#\s][^\n]*", re.MULTILINE)


def text_lines(path: Path, what: str, error: type[CapplanError], limit: int) -> Iterator[tuple[int, str]]:
    """(line number, line) of each line of a regular text file that is neither blank nor a
    `#` comment; at most `limit` bytes in all and MAX_LINE_BYTES a line."""
    text = read_text(path, what, error, limit)
    if "\r" in text:  # CRLF and lone-CR line ends read as one line end each
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    number, counted = 1, 0
    for match in _CONTENT_LINE.finditer(text):
        number += text.count("\n", counted, match.start())
        counted = match.start()
        line = match.group()
        if len(line) > MAX_LINE_BYTES:
            raise error(f"{shown(path)}:{number}: line of {len(line)} characters (at most {MAX_LINE_BYTES})")
        yield number, line


# --- writing ------------------------------------------------------------------

_TEMP = ".{name}.capplan-{pid}.tmp"
_NAME_MAX = 255  # bytes in one file name on the usual file systems


def _temp_name(name: str) -> str:
    """The hidden temporary name beside `name`; a long name is shortened (a hash keeps it
    unique) so that any name the file system takes can be written."""
    full = _TEMP.format(name=name, pid=os.getpid())
    if len(full.encode()) <= _NAME_MAX:
        return full
    import hashlib

    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return _TEMP.format(name=digest, pid=os.getpid())


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def check_output(path: Path, inputs: Iterable[Path] = ()) -> None:
    """Refuse, before any work is written, an output that is an input, a symbolic
    link, or an existing non-regular file."""
    name = shown(path)
    if "\x00" in str(path):
        raise CapplanError(f"{name}: cannot write: the name holds a NUL byte")
    for source in inputs:
        if _same_file(path, source):
            raise CapplanError(
                f"{name}: is also an input of this command; refusing to overwrite it", "write the output somewhere else"
            )
    folder = Path(path).parent if str(Path(path).parent) else Path(".")
    if not folder.is_dir():
        raise CapplanError(f"{name}: cannot write: folder {shown(folder)} does not exist", "create it first")
    if len(Path(path).name.encode("utf-8", "surrogateescape")) > _NAME_MAX:
        raise CapplanError(f"{name}: cannot write: the file name is over {_NAME_MAX} bytes")
    if os.path.islink(path):
        raise CapplanError(
            f"{name}: is a symbolic link; refusing to write through it",
            f"give the real path ({shown(os.path.realpath(path))})",
        )
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CapplanError(f"{name}: cannot write ({exc.strerror})") from None
    if stat.S_ISDIR(info.st_mode):
        raise CapplanError(f"{name}: is a directory", "give a file name")
    if not stat.S_ISREG(info.st_mode):
        raise CapplanError(f"{name}: not a regular file (a device, pipe or socket); refusing to replace it")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep(folder: Path, target: str) -> None:
    """Remove temp files a killed capplan left for `target` (their pid is gone)."""
    stem = _temp_name(target).rsplit(".capplan-", 1)[0].removeprefix(".")
    prefix, suffix = f".{stem}.capplan-", ".tmp"
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for entry in names:
        if entry.startswith(prefix) and entry.endswith(suffix):
            pid = entry[len(prefix) : -len(suffix)]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                try:
                    os.unlink(folder / entry)
                except OSError:
                    pass


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class _Terminated(BaseException):
    """SIGTERM during a write: unwinds like Ctrl-C, so the temp file is removed."""


def write_atomic(path: Path, content: str | bytes, inputs: Iterable[Path] = (), handle_signals: bool = True) -> None:
    """Write `content` (text as UTF-8) to `path`: readers see the old file or the new one, never half.
    `handle_signals`: a SIGTERM while writing removes the temporary file and exits (the CLI)."""
    path = Path(path)
    check_output(path, inputs)
    name = shown(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise CapplanError(f"{name}: cannot write: folder {shown(folder)} does not exist", "create it first")
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    except OSError as exc:
        raise CapplanError(f"{name}: cannot write ({exc.strerror})") from None
    _sweep(folder, path.name)
    tmp = folder / _temp_name(path.name)

    def terminated(signum, frame):  # noqa: ARG001 - signal handler signature
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, terminated) if handle_signals and _main_thread() else None
    try:
        _remove(tmp)  # never through a file planted at the temporary name: a new file, no symlink
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(content.encode("utf-8") if isinstance(content, str) else content)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except _Terminated:
        _remove(tmp)
        raise SystemExit(128 + signal.SIGTERM) from None
    except OSError as exc:
        _remove(tmp)
        raise CapplanError(f"{name}: cannot write ({exc.strerror or exc.__class__.__name__})") from None
    except BaseException:
        _remove(tmp)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def write_for_runtime(path: Path, content: str) -> str | None:
    """What the runtime writes while vLLM runs (the report): the same atomic replace as
    write_atomic, refusing the same outputs, from any thread and without touching signal
    handlers; returns the problem instead of raising (a report must never stop an engine)."""
    try:
        write_atomic(path, content, handle_signals=False)
    except CapplanError as exc:
        return exc.one_line()
    return None


def file_head(path: str, size: int) -> bytes | None:
    """The first `size` bytes of a regular file, None when there is none; never waits (a
    FIFO or device is not opened for reading: OSError), never follows a symbolic link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return os.read(fd, size)
    finally:
        os.close(fd)


def open_stream(path: str, ours: Callable[[str], bool], what: str) -> TextIO:
    """A file the runtime writes line by line as the engine runs (a trace), truncated and
    open for text: never through a symbolic link, never a device or a pipe, and replacing
    only an empty file or one that `ours` recognizes as `what`. OSError otherwise."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    if info.st_size and not ours(path):
        os.close(fd)
        raise OSError(errno.EEXIST, f"exists and is not {what}; refusing to replace it")
    os.set_blocking(fd, True)
    os.ftruncate(fd, 0)
    return os.fdopen(fd, "w", encoding="utf-8")


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass

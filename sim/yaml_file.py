"""Reading a YAML file a person wrote, with every failure told in one line.

A scenario, a sweep and a calibration are all YAML files kvsim did not write: a missing
file, a folder, bytes that are not UTF-8 text, a control character or a bracket left open
must each be told as ``FILE: line N: what is wrong``, never as a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_yaml(path: Path, expected: str, error: type[Exception]) -> Any:
    """``path`` parsed as YAML (a byte-order mark allowed), or ``error`` raised with a
    one-line message naming the file, the line where there is one, and what was
    ``expected`` (e.g. "a scenario YAML file")."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected {expected}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        line = exc.object[:exc.start].count(b"\n") + 1
        raise error(f"{path}: line {line}: not UTF-8 text (byte {exc.object[exc.start]:#04x})"
                    f"; expected {expected}") from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        where = f": line {exc.problem_mark.line + 1}" if exc.problem_mark else ""
        raise error(f"{path}{where}: not valid YAML ({exc.problem})") from None
    except yaml.reader.ReaderError as exc:  # a control character, which YAML forbids
        line = text[:exc.position].count("\n") + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise error(f"{path}: line {line}: not valid YAML ({exc.reason}: #x{code:04x})"
                    ) from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None

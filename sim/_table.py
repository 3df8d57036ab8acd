"""A TOML table read field by field, for scenario files: each field's type and range are
checked as it is read, and a table's fields nobody read are refused, an error naming the file,
the table and the field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from orchestr.errors import ConfigError

__all__ = ["REQUIRED", "Table", "nonneg", "pos"]


class Table:
    """One table of the file, read field by field; an error names ``where`` and the field."""

    def __init__(self, data: Any, file: str, name: str = "") -> None:
        self.file, self.name = file, name
        self.where = f"{file}: [{name}]" if name else file
        if not isinstance(data, dict):
            raise ConfigError(f"{self.where}: expected a table, got {type(data).__name__}")
        self.data = data
        self.read: set[str] = set()

    def get(
        self,
        key: str,
        kind: type | tuple[type, ...],
        default: Any = None,
        *,
        check: Callable[[Any], bool] | None = None,
        want: str = "",
    ) -> Any:
        self.read.add(key)
        if key not in self.data:
            if default is REQUIRED:
                raise ConfigError(f"{self.where}: {key} is required")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if not ok or (check is not None and not check(value)):
            names = want or " or ".join(k.__name__ for k in kinds)
            if not want and check is pos:
                names = f"a positive {names}"
            elif not want and check is nonneg:
                names = f"{names} >= 0"
            raise ConfigError(f"{self.where}: {key} must be {names}, got {value!r}")
        return value

    def table(self, key: str) -> Table:
        self.read.add(key)
        return Table(self.data.get(key, {}), self.file, f"{self.name}.{key}" if self.name else key)

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.read)
        if unknown:
            raise ConfigError(f"{self.where}: unknown field(s) {', '.join(unknown)}")


REQUIRED = object()


def pos(v: Any) -> bool:
    return bool(v > 0)


def nonneg(v: Any) -> bool:
    return bool(v >= 0)

"""One way to check every JSON document: the files a user writes (structure, dataset, hosts,
nodes, links, scenario) and the requests a worker receives (nodes, links, faults, processes).

A ``Schema`` declares an object's fields: each ``Field`` its JSON type, whether it is
required, its default, its bounds (upper bounds included: a ``sync`` of 10**9 is a typo,
not an experiment), its allowed values, whether null is allowed, the items of a list, the
values of a map, the schema of a nested object, or a ``parse`` function for a textual form
(an IPv4 address). ``Schema.validate`` refuses, with the file (or request) and the place named:

- an unknown field, with the nearest valid name::

      gl_structure.json: node_list[2] (n3), field 'epochs': unknown field; did you mean 'epoch'?

- a wrong type (``true`` is never a number, ``"3"`` never an integer),
- a value out of range or not among the allowed ones,
- a missing required field.

It returns a copy holding every declared field (defaults filled in, integers given to a
float field turned into floats; a field whose default is ``ABSENT`` is left out when absent,
for requests where a key left out keeps what is there). Files are read by ``read_json``: duplicate keys, NaN and
Infinity are refused too. The error class is the caller's (``ConfigError`` by default,
``TopologyError`` for the network files), so callers keep their error hierarchy.
"""
from __future__ import annotations

import copy
import difflib
import ipaddress
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

from worker.api.errors import ConfigError

_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
               dict: "an object"}


class Refused(ValueError):
    """A ``parse`` function's refusal that says all there is to say: reported as it is, without
    the field's expected form."""


class Place:
    """Where a value sits: ``file: part, part`` (``str(place)`` starts every message)."""

    def __init__(self, file: str, parts: tuple[str, ...] = (), sep: str = ": ") -> None:
        self.file, self.parts, self.sep = file, parts, sep

    @classmethod
    def of(cls, where: Union["Place", str]) -> "Place":
        """``where`` as a Place; a text that already names a place gets ``, field ...`` appended."""
        if isinstance(where, Place):
            return where
        return cls(where, sep=", " if ": " in where else ": ")

    def at(self, part: str) -> "Place":
        return Place(self.file, (*self.parts, part), self.sep)

    def field(self, name: str) -> str:
        return str(self.at(f"field {name!r}"))

    def __str__(self) -> str:
        return f"{self.file}{self.sep}{', '.join(self.parts)}" if self.parts else self.file


def describe(value: Any) -> str:
    """A short account of a JSON value for messages: ``the string '3'``, ``true``, ``a list``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, (int, float)):
        return repr(value)
    return "a list" if isinstance(value, list) else "an object" if isinstance(value, dict) else type(value).__name__


def suggestion(key: object, valid: Iterable[str]) -> str:
    """``; did you mean 'epoch'?`` for the nearest valid name, else the list of valid names."""
    valid = list(valid)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    if not close:
        close = [v for v in valid if str(key).lower() == v.lower()]
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; valid fields: {', '.join(valid)}" if valid else "; no field is allowed here"


class _Absent:
    """The default of a field that is left out of ``Schema.validate``'s copy when absent."""

    def __repr__(self) -> str:
        return "ABSENT"

    def __deepcopy__(self, memo: dict) -> "_Absent":
        return self


ABSENT: Any = _Absent()


def _bound(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class Field:
    """One declared field; ``kind`` is int, float, str, bool, list, dict or a tuple of them."""

    kind: Any
    doc: str = ""
    required: bool = False
    default: Any = None
    low: Optional[float] = None       # smallest allowed number (or list length via min_items)
    high: Optional[float] = None      # largest allowed number: every number has one
    low_open: bool = False            # low itself is excluded: (low, high]
    choices: Optional[tuple] = None
    items: Optional["Field"] = None   # what each element of a list must be
    min_items: int = 0
    max_items: Optional[int] = None
    schema: Optional["Schema"] = None  # what a nested object must be
    max_len: Optional[int] = None     # strings
    pattern: Optional[re.Pattern] = None  # strings, matched in full
    hint: str = ""                    # the expected form, for pattern and parse errors
    nullable: bool = False            # null is allowed (and kept as None)
    values: Optional["Field"] = None  # what each value of a map (an object of any keys) must be
    parse: Optional[Callable[[Any], Any]] = None  # normalises a value; ValueError: not ``hint``

    def kinds(self) -> tuple:
        return self.kind if isinstance(self.kind, tuple) else (self.kind,)

    def rule(self) -> str:
        """The constraint in words: ``an integer in [1, 100000]``."""
        names = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in self.kinds())
        if self.choices is not None:
            return f"one of {', '.join(map(repr, self.choices))}"
        null = " or null" if self.nullable else ""
        if self.low is not None and self.high is not None:
            return f"{names} in {'(' if self.low_open else '['}{_bound(self.low)}, {_bound(self.high)}]{null}"
        if self.low is not None:
            return f"{names} {'>' if self.low_open else '>='} {_bound(self.low)}{null}"
        if self.high is not None:
            return f"{names} <= {_bound(self.high)}{null}"
        return names + null

    def check(self, value: Any, place: Place, name: str, error: type) -> Any:
        """``value`` checked (and normalised: int -> float for float fields); ``name`` is its label."""
        where = place.field(name)
        if value is None and self.nullable:
            return None
        kinds = self.kinds()
        ok = any(isinstance(value, k) and not (isinstance(value, bool) and k is not bool)
                 or (k is float and isinstance(value, int) and not isinstance(value, bool)) for k in kinds)
        if not ok:
            names = " or ".join([_TYPE_NAMES.get(k, k.__name__) for k in kinds] + ["null"] * self.nullable)
            raise error(f"{where}: expected {self.rule() if self.choices is None else names}, got {describe(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise error(f"{where}: must be a finite number, got {value!r}")
        if float in kinds and int not in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if self.choices is not None and value not in self.choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in self.choices], n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise error(f"{where}: {value!r} is not {self.rule()}{hint}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
            too_high = self.high is not None and value > self.high
            if too_low or too_high:
                raise error(f"{where}: must be {self.rule()}, got {value!r}")
        if isinstance(value, str):
            if self.max_len is not None and len(value) > self.max_len:
                raise error(f"{where}: longer than {self.max_len} characters")
            if self.pattern is not None and not self.pattern.fullmatch(value):
                raise error(f"{where}: {value!r:.60} is not {self.hint or 'of the expected form'}")
        if isinstance(value, list):
            if len(value) < self.min_items or self.max_items is not None and len(value) > self.max_items:
                most = f" and at most {self.max_items}" if self.max_items is not None else ""
                raise error(f"{where}: must hold at least {self.min_items}{most} items, got {len(value)}")
            if self.items is not None:
                value = [self.items.check(v, place, f"{name}[{i}]", error) for i, v in enumerate(value)]
        if isinstance(value, dict) and self.values is not None:
            if self.max_items is not None and len(value) > self.max_items:
                raise error(f"{where}: must hold at most {self.max_items} entries, got {len(value)}")
            value = {k: self.values.check(v, place.at(name), str(k), error) for k, v in value.items()}
        if isinstance(value, dict) and self.schema is not None:
            value = self.schema.validate(value, place.at(name), error)
        if self.parse is not None:
            try:
                value = self.parse(value)
            except Refused as e:
                raise error(f"{where}: {value!r:.300}: {e}") from None
            except (ValueError, TypeError) as e:
                raise error(f"{where}: {value!r:.60} is not {self.hint or 'of the expected form'} ({e})") from None
        return value


def refuse_unknown(data: dict, allowed: Iterable[str], place: Union[Place, str], error: type = ConfigError) -> None:
    """Refuse the first key of ``data`` not in ``allowed``, naming the nearest allowed one."""
    allowed = list(allowed)
    for key in data:
        if key not in allowed:
            raise error(f"{Place.of(place).field(key)}: unknown field{suggestion(key, allowed)}")


class Schema:
    """The declared fields of one JSON object."""

    def __init__(self, fields: dict[str, Field], doc: str = "") -> None:
        self.fields, self.doc = fields, doc

    def unknown(self, data: dict, place: Union[Place, str], error: type = ConfigError) -> None:
        """Refuse the first key that is not declared, naming the nearest declared one."""
        refuse_unknown(data, self.fields, place, error)

    def check_keys(self, data: Any, place: Union[Place, str], error: type = ConfigError) -> dict[str, Any]:
        """``data`` is an object with only declared fields and every required one; the values are
        left to ``validate`` (a first pass, when a field such as a name is needed to name the place)."""
        place = Place.of(place)
        if not isinstance(data, dict):
            raise error(f"{place}: expected an object, got {describe(data)}")
        self.unknown(data, place, error)
        for name, f in self.fields.items():
            if f.required and name not in data:
                raise error(f"{place}: missing field {name!r}" + (f" ({f.doc})" if f.doc else ""))
        return data

    def validate(self, data: Any, place: Union[Place, str], error: type = ConfigError) -> dict[str, Any]:
        """``data`` checked field by field; a copy with every declared field (None when absent
        and without default; left out when absent with the default ``ABSENT``)."""
        place = Place.of(place)
        self.check_keys(data, place, error)
        out: dict[str, Any] = {}
        for name, f in self.fields.items():
            if name not in data:
                if f.default is not ABSENT:
                    out[name] = copy.deepcopy(f.default)
                continue
            out[name] = f.check(data[name], place, name, error)
        return out


class _JsonProblem(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _JsonProblem(f"key {key!r} appears twice in one object (JSON would keep only the last)")
        result[key] = value
    return result


def _no_constant(name: str) -> Any:
    raise _JsonProblem(f"{name} is not a valid number here")


def read_json(path: str, error: type = ConfigError, label: Optional[str] = None) -> Any:
    """The JSON document in ``path``; unreadable, invalid, duplicate keys, NaN: ``error``
    naming ``label`` (default: the path)."""
    label = label or path
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{label}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise error(f"{label}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except _JsonProblem as e:
        raise error(f"{label}: {e}") from None


def read_object(path: str, error: type = ConfigError, example: str = "") -> dict[str, Any]:
    """``read_json`` that must give an object."""
    data = read_json(path, error)
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object{' like ' + example if example else ''}, got {describe(data)}")
    return data


# Bounds shared by several files ------------------------------------------------------------
MAX_ROUNDS = 100_000          # sync: rounds of an experiment
MAX_EPOCHS = 1000             # local epochs per round
MAX_SECONDS = 86_400          # every timeout, deadline and wait: one day
MAX_BATCH = 65_536
MAX_SEED = 2**32 - 1
MAX_HIDDEN_UNITS = 65_536     # units of one hidden layer
MAX_HIDDEN_LAYERS = 16
MAX_LEARNING_RATE = 10.0

SEED = Field(int, "random seed", low=0, high=MAX_SEED)
IPV4_ADDRESS = Field(str, "an IPv4 address", hint="an IPv4 address",
                     parse=lambda v: str(ipaddress.IPv4Address(v)))
IPV4_PREFIX = Field(str, "an IPv4 prefix", hint="an IPv4 prefix",
                    parse=lambda v: str(ipaddress.IPv4Network(v)))

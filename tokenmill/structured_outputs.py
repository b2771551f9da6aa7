"""StructuredOutputsParams: constrain a request's output to a JSON schema, any JSON object, a regular
expression, one of a list of strings, or an EBNF grammar. Exactly one is set.

It lives beside SamplingParams (below engine and runner) and holds only the description: the engine
compiles it (engine/grammar.py) and hands the runner packed token masks.
"""

import json
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

from tokenmill.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Keywords whose values are data, not schemas: a {"$ref": ...} inside them is no reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def _refs(schema: Any) -> Iterator[str]:
    """Every `$ref` of a JSON schema."""
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k == "$ref" and isinstance(v, str):
                yield v
            elif k not in _DATA_KEYWORDS:
                yield from _refs(v)
    elif isinstance(schema, list):
        for v in schema:
            yield from _refs(v)


def non_local_ref(schema: Any) -> Optional[str]:
    """The first `$ref` that points outside the schema (a URL, a file), if any: the compiler would
    drop it silently and constrain nothing there, so such schemas are refused."""
    return next((r for r in _refs(schema) if not r.startswith("#")), None)


def non_local_ref_message(ref: str) -> str:
    return (f"$ref {ref!r} is not supported: only references within the schema itself ('#', '#/$defs/...') "
            "are resolved (nothing is fetched)")


def relocate_refs(schema: Any, pointer: str) -> Any:
    """A copy of `schema` for embedding at JSON pointer `pointer` ('#/a/b') of a larger schema: its
    local `$ref`s ('#', '#/$defs/X') are rewritten to point under `pointer`, so they still resolve."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                out[k] = pointer + v[1:]
            elif k in _DATA_KEYWORDS:
                out[k] = v
            else:
                out[k] = relocate_refs(v, pointer)
        return out
    if isinstance(schema, list):
        return [relocate_refs(v, pointer) for v in schema]
    return schema


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: Union[None, dict, str] = None  # a JSON schema (a dict, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: Optional[str] = None
    choice: Optional[list] = None  # the output is exactly one of these strings
    grammar: Optional[str] = None  # EBNF in xgrammar's (GBNF-like) syntax, start rule `root`

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        set_ = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(set_) != 1:
            raise InvalidRequestError("structured_outputs needs exactly one of json, json_object, regex, choice, "
                                      f"grammar (got {', '.join(set_) if set_ else 'none'})")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("structured_outputs.json must be a JSON schema (an object)")
            bad = non_local_ref(schema)
            if bad is not None:
                raise InvalidRequestError(f"structured_outputs.json: {non_local_ref_message(bad)}")
        if self.json_object is not False and self.json_object is not True:
            raise InvalidRequestError("structured_outputs.json_object must be a boolean")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise InvalidRequestError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise InvalidRequestError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                raise InvalidRequestError("structured_outputs.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The canonical spec string: equal for specs that compile to the same grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
            return "json:" + json.dumps(value, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return "choice:" + json.dumps(list(value))
        if kind == "json_object":
            return "json_object"
        return f"{kind}:{value}"

    @classmethod
    def coerce(cls, value) -> "StructuredOutputsParams":
        """From an instance or a mapping of its fields (unknown fields refused by name)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(KINDS))
            if unknown:
                raise InvalidRequestError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
            return cls(**value)
        raise InvalidRequestError("structured_outputs must be a StructuredOutputsParams or a mapping")

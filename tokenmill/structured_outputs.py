"""StructuredOutputsParams: constrain a request's output to a JSON schema, any JSON object, a regular
expression, one of a list of strings, or an EBNF grammar. Exactly one is set.

It lives beside SamplingParams (below engine and runner) and holds only the description: the engine
compiles it (engine/grammar.py) and hands the runner packed token masks.
"""

import json
from dataclasses import dataclass
from typing import Optional, Union

from tokenmill.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


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

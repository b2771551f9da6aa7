"""Structured output fields of the HTTP API -> StructuredOutputsParams.

Accepted: chat's `response_format` (`{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
{"name": ..., "schema": {...}}}`, or `"text"`), vLLM's `structured_outputs` object (json, json_object,
regex, choice, grammar), and the older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` fields. At most one of them may constrain a request; anything malformed is an
InvalidRequestError (a 400 naming the field).
"""

from typing import Optional

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_outputs import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def from_response_format(fmt: Optional[dict]) -> Optional[StructuredOutputsParams]:
    if not fmt:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("response_format json_schema needs a 'json_schema' object with a 'schema'")
        schema = spec.get("schema")
        if schema is None:
            raise InvalidRequestError("response_format.json_schema needs a 'schema'")
        if not isinstance(schema, (dict, str)):
            raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    raise InvalidRequestError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")


def structured_outputs_of(req) -> Optional[StructuredOutputsParams]:
    """The request's constraint, from whichever single field sets one."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = from_response_format(getattr(req, "response_format", None))
    if fmt is not None:
        found.append(("response_format", fmt))
    if getattr(req, "structured_outputs", None) is not None:
        found.append(("structured_outputs", StructuredOutputsParams.coerce(dict(req.structured_outputs))))
    for name, kind in GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, StructuredOutputsParams.coerce({kind: value})))
    if len(found) > 1:
        raise InvalidRequestError(f"only one structured output field may be set (got {', '.join(n for n, _ in found)})")
    return found[0][1] if found else None

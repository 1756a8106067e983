"""The grammar an answer must follow, as llguidance grammar text (engine/grammar.py applies it):
from `response_format` (json_object, json_schema) or from a forced tool call (tool_choice
"required" or a named tool), in the served model's tool format. Built and checked here, when
the request arrives, so a schema llguidance cannot compile is a 400 naming the field, never a
failure in a worker; the worker compiles the same text again off its step loop (cached).

JSON is written compactly, `", "` between items and `": "` after keys, with no other
whitespace: a weak model cannot then spend its answer on blank lines inside the object."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance

from shapes.errors import ApiError
from shapes.parsing import ToolFormat
from shapes.requests import ChatCompletionRequest, FunctionSpec

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def answer_grammar(body: ChatCompletionRequest, fmt: ToolFormat) -> str | None:
    """The grammar of this body's answer, or None when it is free."""
    forced = body.forced_tools()
    if forced is not None:
        return _checked(tool_call_grammar(forced, fmt, several=body.parallel_tool_calls is not False),
                        "tool_choice" if body.tool_choice != "required" else "tools")
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return _checked(schema_grammar({"type": "object"}), "response_format")
    assert rf.json_schema is not None
    schema = rf.json_schema.schema_
    _check_schema(schema, "response_format.json_schema.schema")
    return _checked(schema_grammar(schema), "response_format.json_schema.schema")


def schema_grammar(schema: dict[str, Any]) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)  # type: ignore[arg-type]


def call_schema(function: FunctionSpec, fmt: ToolFormat) -> dict[str, Any]:
    """One call's JSON, as the format writes it: {"name": <the name>, <arguments key>: <its parameters>}."""
    parameters = function.parameters or NO_ARGUMENTS
    return {"type": "object", "properties": {"name": {"const": function.name}, fmt.arguments_key: parameters},
            "required": ["name", fmt.arguments_key], "additionalProperties": False}


def tool_call_grammar(functions: list[FunctionSpec], fmt: ToolFormat, several: bool) -> str:
    """One call (or, with `several`, one or more) of one of `functions`, and nothing else."""
    for function in functions:
        if function.parameters is not None:
            _check_schema(function.parameters, f"tools.{function.name}.parameters")
    one = call_schema(functions[0], fmt) if len(functions) == 1 else {
        "anyOf": [call_schema(f, fmt) for f in functions]}
    # x-guidance: the same compact style inside the call as in response_format
    call = f"%json {json.dumps({**one, 'x-guidance': JSON_STYLE})}"
    if fmt.is_list:
        body = f'"[" {call} ("," " " {call})* "]"' if several else f'"[" {call} "]"'
        rules = f"start: {json.dumps(fmt.start)} {body}\n"
    elif fmt.start:
        more = ' ("\\n" call)*' if several else ""
        rules = f"start: call{more}\ncall: {json.dumps(fmt.start + chr(10))} {call} {json.dumps(chr(10) + fmt.end)}\n"
    else:  # the whole answer is one call's JSON
        rules = f"start: {call}\n"
    return llguidance.LLMatcher.grammar_from_lark(rules)


def _check_schema(schema: object, param: str) -> None:
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} must be a JSON Schema object.", code="invalid_value", param=param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        raise ApiError(400, f"{param} is not a valid JSON Schema: {error.message}", code="invalid_value",
                       param=param) from None


def _checked(grammar: str, param: str) -> str:
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        raise ApiError(400, f"{param}: this schema cannot be enforced: {problem}", code="invalid_value", param=param)
    return grammar

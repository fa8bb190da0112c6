"""The request fields that constrain a reply, checked into a `serve.api.grammar.Constraint`: `response_format`
(chat completions, completions), `text.format` (Responses), `tools` / `tool_choice` / `parallel_tool_calls`
(chat completions in OpenAI's nested function shape, Responses in its flat one). Every refusal is a 400
naming the field; sizes are checked against `grammar.GrammarLimits` before anything compiles."""

from __future__ import annotations

import re

from serve.api import grammar
from serve.api.protocol import ApiError, show

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function and schema names
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _name(v, where: str, param: str) -> str:
  if not isinstance(v, str) or not NAME.match(v):
    raise ApiError(
      400, f"'{where}' is {show(v, 40)}: expected 1-64 letters, digits, underscores or dashes.", param
    )
  return v


def _schema(v, where: str, param: str) -> dict:
  if not isinstance(v, dict):
    raise ApiError(400, f"'{where}' is {show(v, 40)}: expected a JSON schema object.", param)
  return v


def _bool(v, default: bool, where: str, param: str) -> bool:
  if v is None:
    return default
  if not isinstance(v, bool):
    raise ApiError(400, f"'{where}' is {show(v, 40)}: expected true or false.", param)
  return v


def json_format(fmt, param: str, flat: bool, limits: grammar.GrammarLimits) -> grammar.Constraint | None:
  """`response_format` ({"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
  "strict"}}) or, `flat`, Responses' `text.format` (the json_schema fields beside "type")."""
  if fmt is None:
    return None
  kind = fmt.get("type") if isinstance(fmt, dict) else None
  if kind == "text":
    return None
  if kind == "json_object":
    return grammar.Constraint("json_object")
  if kind != "json_schema":
    raise ApiError(
      400,
      f'\'{param}\' is {show(fmt, 60)}: expected {{"type": "text"}}, {{"type": "json_object"}} or '
      '{"type": "json_schema", ...}.',
      param,
    )
  spec = fmt if flat else fmt.get("json_schema")
  where = param if flat else f"{param}.json_schema"
  if not isinstance(spec, dict):
    raise ApiError(400, f'\'{where}\' is {show(spec, 40)}: expected {{"name", "schema", "strict"}}.', param)
  _name(spec.get("name"), f"{where}.name", param)
  schema = _schema(spec.get("schema", {"type": "object"}), f"{where}.schema", param)
  c = grammar.Constraint(
    "json_schema", schema=schema, strict=_bool(spec.get("strict"), False, f"{where}.strict", param)
  )
  grammar.check_size(c, limits, param)
  return c


def _tool(t, i: int, flat: bool) -> grammar.Tool:
  where = f"tools[{i}]"
  if not isinstance(t, dict) or t.get("type") != "function":
    kind = t.get("type") if isinstance(t, dict) else t
    raise ApiError(
      400, f"'{where}' is a {show(kind, 40)} tool: this server calls function tools only.", "tools"
    )
  fn = t if flat else t.get("function")
  fwhere = where if flat else f"{where}.function"
  if not isinstance(fn, dict):
    raise ApiError(400, f'\'{fwhere}\' is {show(fn, 40)}: expected {{"name", "parameters"}}.', "tools")
  desc = fn.get("description")
  if desc is not None and not isinstance(desc, str):
    raise ApiError(400, f"'{fwhere}.description' is {show(desc, 40)}: expected a string.", "tools")
  params = fn.get("parameters")
  return grammar.Tool(
    name=_name(fn.get("name"), f"{fwhere}.name", "tools"),
    parameters=EMPTY_PARAMETERS if params is None else _schema(params, f"{fwhere}.parameters", "tools"),
    strict=_bool(fn.get("strict"), False, f"{fwhere}.strict", "tools"),
    description=desc,
  )


def tools(
  obj: dict, flat: bool, limits: grammar.GrammarLimits, lead: str = ""
) -> tuple[grammar.Constraint | None, tuple[grammar.Tool, ...]]:
  """`tools`, `tool_choice`, `parallel_tool_calls` of a request (flat: Responses' tool shape): the
  constraint (None: no tools, or tool_choice "none") and the tools (for the template, whatever the choice).
  `lead`: text the model writes before a call it must make (the default template's space after
  "Assistant:")."""
  raw = obj.get("tools")
  if raw is None:
    raw = []
  if not isinstance(raw, list):
    raise ApiError(400, f"'tools' is {show(raw, 40)}: expected a list of function tools.", "tools")
  if len(raw) > limits.max_tools:
    raise ApiError(
      400,
      f"'tools' has {len(raw)} tools: at most {limits.max_tools} (the limit on tools per request).",
      "tools",
    )
  ts = tuple(_tool(t, i, flat) for i, t in enumerate(raw))
  names = [t.name for t in ts]
  if len(set(names)) < len(names):
    raise ApiError(400, "'tools' names a function twice: each name must be unique.", "tools")
  choice = obj.get("tool_choice")
  if choice is None:
    choice = "auto"
  if isinstance(choice, dict):
    fn = choice if flat else choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict):
      want = (
        '{"type": "function", "name": ...}' if flat else '{"type": "function", "function": {"name": ...}}'
      )
      raise ApiError(400, f"'tool_choice' is {show(choice, 60)}: expected a string or {want}.", "tool_choice")
    choice = _name(fn.get("name"), "tool_choice.name", "tool_choice")
    if choice not in names:
      raise ApiError(400, f"'tool_choice' names {choice!r}, which is not in 'tools'.", "tool_choice")
  elif choice not in ("none", "auto", "required"):
    raise ApiError(
      400,
      f'\'tool_choice\' is {show(choice, 40)}: expected "none", "auto", "required" or a named function.',
      "tool_choice",
    )
  elif choice == "required" and not ts:
    raise ApiError(400, "'tool_choice' is \"required\" but 'tools' is empty.", "tool_choice")
  parallel = _bool(obj.get("parallel_tool_calls"), True, "parallel_tool_calls", "parallel_tool_calls")
  if choice == "none" or not ts:
    return None, ts
  c = grammar.Constraint("tools", tools=ts, choice=choice, parallel=parallel, lead=lead)
  grammar.check_size(c, limits, "tools")
  return c, ts


def hf_tools(ts) -> list:
  """Tools as Hugging Face chat templates take them ([{"type": "function", "function": {...}}])."""
  out = []
  for t in ts:
    fn = {"name": t.name, "parameters": t.parameters}
    if t.description is not None:
      fn["description"] = t.description
    out.append({"type": "function", "function": fn})
  return out

"""The command lines' one flag style: words joined by underscores, the names of the config fields
(`--hlo_dir`, `--model.d_model`), with the dashed spelling (`--hlo-dir`) accepted everywhere as an alias.
Help shows the underscore spelling only. Used by `python -m train`, `train.prepare`, `train.eval`,
`train.recall` and `python -m serve`.

A dataclass's field help is the string literal on the line after the field (the attribute-docstring
convention of PEP 257, which Sphinx and editors read), so each field is described once, beside it:

    d_model: int = 3072
    \"\"\"hidden width D\"\"\"
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import inspect
import logging
import sys
import textwrap


def _key(flag: str) -> str:
  return flag.replace("-", "_")


class FlagParser(argparse.ArgumentParser):
  """An ArgumentParser whose long flags may be written with '-' or '_' between words: `--hlo-dir`,
  `--hlo_dir` and `--no-progress`, `--no_progress` name the same flag. Flags are added in the underscore
  spelling (a dashed long flag is refused at definition, so the help keeps one style)."""

  def _add_action(self, action):
    _check_spelling(action)
    return super()._add_action(action)

  def add_argument_group(self, *args, **kwargs):
    group = super().add_argument_group(*args, **kwargs)
    add = group._add_action

    def checked(action):
      _check_spelling(action)
      return add(action)

    group._add_action = checked
    return group

  def parse_args(self, args=None, namespace=None):  # type: ignore[override]
    """As argparse's, but an unknown flag is one short error naming the closest valid flag."""
    ns, extra = self.parse_known_args(args, namespace)
    if extra:
      self.error("; ".join(self.unknown(a) for a in extra if a.startswith("-")) or f"unexpected {extra}")
    return ns

  def unknown(self, arg: str) -> str:
    """'unknown flag --x' with the closest valid flag (difflib), if one is close."""
    name = arg.partition("=")[0]
    known = [s for s in self._option_string_actions if s.startswith("--")]
    by_field = {s.rsplit(".", 1)[-1]: s for s in known if "." in s}  # --d_model -> --model.d_model
    key = "--" + _key(name.lstrip("-"))
    close = [by_field[key]] if key in by_field else difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"unknown flag {name}" + (f"; did you mean {close[0]}?" if close else "")

  def error(self, message: str):
    """One line and the way to the full list, not the whole usage (python -m train has ~100 flags)."""
    self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists every flag)\n")

  def parse_known_args(self, args=None, namespace=None):
    args = sys.argv[1:] if args is None else list(args)
    return super().parse_known_args(self.respell(args), namespace)

  def respell(self, args: list[str]) -> list[str]:
    """`args` with each long flag (before a bare `--`) in the spelling it was added with."""
    known = {_key(s): s for s in self._option_string_actions if s.startswith("--")}
    out: list[str] = []
    for i, a in enumerate(args):
      if a == "--":
        return out + args[i:]
      name, eq, value = a.partition("=")
      if a.startswith("--") and name not in self._option_string_actions and _key(name) in known:
        a = known[_key(name)] + eq + value
      out.append(a)
    return out


def _check_spelling(action):
  for s in action.option_strings:
    if s.startswith("--") and "-" in s[2:]:
      raise ValueError(
        f"flag {s}: the command lines spell flags with underscores ({'--' + _key(s[2:])}); "
        "the dashed spelling is accepted as an alias automatically"
      )


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
  """Help that appends "(default: X)" once: not where the help already says its default, and not for a
  default of None or False (an unset option, an off switch)."""

  def _get_help_string(self, action):
    text = action.help or ""
    if "default" in text or action.default in (None, False, argparse.SUPPRESS) or action.default == []:
      return text
    return super()._get_help_string(action)


class Toggle(argparse.Action):
  """A boolean flag and its negation: `--progress` / `--no_progress` (also `--no-progress`)."""

  def __init__(self, option_strings, dest, default=None, required=False, help=None):
    strings = [t for s in option_strings for t in ((s, "--no_" + s[2:]) if s.startswith("--") else (s,))]
    super().__init__(strings, dest, nargs=0, default=default, required=required, help=help)

  def __call__(self, parser, namespace, values, option_string=None):
    setattr(namespace, self.dest, not option_string.startswith("--no_"))

  def format_usage(self) -> str:
    return " | ".join(self.option_strings)


@functools.cache
def field_docs(cls) -> dict[str, str]:
  """{field name: its docstring, whitespace collapsed} for each field of `cls` that has one."""
  tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
  cls_def = tree.body[0]
  if not isinstance(cls_def, ast.ClassDef):
    raise TypeError(f"field_docs({cls!r}): expected a class, got a {type(cls_def).__name__}")
  body = cls_def.body
  docs = {}
  for node, after in zip(body, body[1:]):
    if (
      isinstance(node, ast.AnnAssign)
      and isinstance(node.target, ast.Name)
      and isinstance(after, ast.Expr)
      and isinstance(after.value, ast.Constant)
      and isinstance(after.value.value, str)
    ):
      docs[node.target.id] = " ".join(after.value.value.split())
  return docs


def field_help(cls, name: str) -> str:
  """The field's docstring; a field without one is a defect the CLI tests catch (empty help)."""
  return field_docs(cls).get(name, "")


# The libraries whose INFO lines mean nothing to a user of the programs: JAX's platform probe ("Unable to
# initialize backend 'tpu'"), and grain and Orbax, which log through absl (Orbax ~18 lines per load).
THIRD_PARTY_LOGGERS = ("absl", "jax", "orbax", "grain", "etils")


def set_verbosity(verbose: bool) -> None:
  """Third-party loggers at INFO with `verbose`, else at ERROR for absl (grain's notice about its profiler,
  Orbax's progress) and WARNING for the rest."""
  for name in THIRD_PARTY_LOGGERS:
    quiet = logging.ERROR if name == "absl" else logging.WARNING
    logging.getLogger(name).setLevel(logging.INFO if verbose else quiet)

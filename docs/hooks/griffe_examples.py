"""Griffe extension for the API reference (mkdocs.yml): the package's docstrings head their doctests
``Example:``, which the Google parser reads as an admonition of Markdown text (``>>>`` would become quotes);
rename that heading to ``Examples:``, the section whose ``>>>`` lines render as code; show Sphinx roles
(:meth:`x`) as code; and give each name of a grouped argument (``device, dtype: as nn.Linear.``) its own entry,
since the parameter table looks each entry's name up in the signature and would call a group of names, which it
cannot find there, "required" whatever their defaults."""

import re

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:meth|func|class|mod|data|attr|exc|obj):`~?([^`]+)`")  # Sphinx roles: shown as code
_ARGS = re.compile(r"^(\s*)(?:Args|Arguments|Parameters|Params):\s*$")
_GROUPED = re.compile(r"^(\s+)(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)+)(\s*\([^)]*\))?:(.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def split_grouped_parameters(text: str) -> str:
    """``text`` with each entry of an arguments section that names several parameters (``a, b: description``,
    its continuation lines included) repeated once per name.

    Example:
        >>> text = "Args:\\n    a, b: shared.\\n        more.\\n    c: own.\\nReturns:\\n    x, y: z"
        >>> print(split_grouped_parameters(text))
        Args:
            a: shared.
                more.
            b: shared.
                more.
            c: own.
        Returns:
            x, y: z
    """
    lines, out, i = text.split("\n"), [], 0
    section = None  # the indentation of the arguments heading whose entries are being read
    while i < len(lines):
        line = lines[i]
        if line.strip() and section is not None and _indent(line) <= section:
            section = None
        heading = _ARGS.match(line)
        if heading:
            section = len(heading.group(1))
            out.append(line)
            i += 1
            continue
        grouped = _GROUPED.match(line) if section is not None else None
        if grouped is None:
            out.append(line)
            i += 1
            continue
        indent, names, kind, rest = grouped.groups()
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > len(indent)):
            j += 1
        while j > i + 1 and not lines[j - 1].strip():  # blank lines after the entry stay after it
            j -= 1
        for name in (n.strip() for n in names.split(",")):
            out += [f"{indent}{name}{kind or ''}:{rest}", *lines[i + 1:j]]
        i = j
    return "\n".join(out)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            text = _HEADING.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = split_grouped_parameters(_ROLE.sub(r"`\1`", text))

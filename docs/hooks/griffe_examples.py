"""Griffe extension for the API reference (mkdocs.yml): the package's docstrings head their doctests
``Example:``, which the Google parser reads as an admonition of Markdown text (``>>>`` would become quotes);
rename that heading to ``Examples:``, the section whose ``>>>`` lines render as code; and show Sphinx roles
(:meth:`x`) as code."""

import re

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:meth|func|class|mod|data|attr|exc|obj):`~?([^`]+)`")  # Sphinx roles: shown as code


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            text = _HEADING.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(r"`\1`", text)

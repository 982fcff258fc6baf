"""A griffe extension for the API reference: clusterkit's numpy-style docstrings describe
related parameters together (``objective, n_trials, client`` and one description that takes
them in order). numpydoc reads such a line as parameters of one type, so griffe would give all
of them the first one's type and default. Here each gets its own entry, whose type and default
griffe then takes from the signature, with the description they share.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

SECTION = re.compile(r"^Parameters\n-+\n(.*?)(?=^\S[^\n]*\n-+\n|\Z)", re.M | re.S)
ITEM = re.compile(r"^(\S[^\n]*)\n((?:[ \t]+[^\n]*\n?|\n(?=[ \t]))*)", re.M)


def split_items(section: str) -> str:
    out = []
    for match in ITEM.finditer(section):
        head, body = match[1], match[2]
        names = head.split(", ")
        if " : " in head or len(names) == 1:
            out.append(match[0].rstrip("\n"))
            continue
        text = " ".join(body.split())
        out += [f"{name}\n    *{', '.join(names)}, in order:* {text}" for name in names]
    return "\n".join(out) + "\n\n"


class GroupedParameters(griffe.Extension):
    def on_function_instance(self, *, func: Any, **kwargs: Any) -> None:
        docstring = func.docstring
        if docstring is None or "Parameters\n" not in docstring.value:
            return
        docstring.value = SECTION.sub(
            lambda m: m[0][: m.start(1) - m.start(0)] + split_items(m[1]), docstring.value
        )

"""A mkdocs hook that renders the documentation's maths as MathML when the site is
built, so that browsers show it natively: no script, no font and no network access,
at build time or when reading.

`pymdownx.arithmatex` (with `generic: true`) marks the maths of pages and docstrings
as `<span class="arithmatex">\\(...\\)</span>` (inline, `$...$`) and
`<div class="arithmatex">\\[...\\]</div>` (display, `$$...$$`); this hook converts each
to a `<math>` element with `latex2mathml`.
"""

import html
import re

from latex2mathml.converter import convert


_MATH = re.compile(
    r'<(span|div) class="arithmatex">\s*\\[(\[](.*?)\\[)\]]\s*</\1>', re.DOTALL
)


def _to_mathml(match: re.Match) -> str:
    tag, tex = match.groups()
    return convert(html.unescape(tex), display="block" if tag == "div" else "inline")


def on_page_content(html_text: str, **kwargs) -> str:
    return _MATH.sub(_to_mathml, html_text)

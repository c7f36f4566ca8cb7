"""mkdocs hooks: generated sections, and the bundled mermaid on the pages that draw diagrams.

``<!-- generate: module:function -->`` is replaced with what the function returns. Generated
sections (the lease state diagram, the hook reference, the error table) come from the code
itself, so the docs cannot drift from it. A marker naming something that does not exist fails
the (strict) build.

mkdocs-material draws ```` ```mermaid ```` blocks with the page's global ``mermaid`` and loads
it from a CDN only when there is none. Every page with a diagram therefore gets a ``<script>``
for the copy of mermaid shipped with the site (:data:`MERMAID_JS`, under ``docs/``), before the
theme's bundle: the site draws its diagrams offline, and pages without one load no mermaid.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from mkdocs.utils import get_relative_url

_MARKER = re.compile(r"<!--\s*generate:\s*([\w.]+):(\w+)\s*-->")

#: The bundled mermaid, relative to ``docs/``: ``dist/mermaid.min.js`` of the mermaid release
#: :data:`MERMAID_VERSION` (MIT, ``LICENSE.txt`` beside it), byte for byte.
MERMAID_JS = "assets/mermaid/mermaid.min.js"
MERMAID_VERSION = "11.12.0"
#: sha256 of that file: the release's own (npm ``mermaid@11.12.0``, ``dist/mermaid.min.js``).
MERMAID_SHA256 = "07e37dfa97b337ccc85365d57eddf99b9706f09db3b59b260d0333b23b343c4b"

_DIAGRAM = '<pre class="mermaid">'
_THEME_BUNDLE = re.compile(r'<script src="[^"]*assets/javascripts/bundle\.[^"]*"')


def _render(match: re.Match[str]) -> str:
    module = importlib.import_module(match.group(1))
    func = getattr(module, match.group(2))
    return str(func())


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _MARKER.sub(_render, markdown)


def mermaid_script(output: str, page_url: str) -> str:
    """``output`` (a page's HTML) with a script tag for :data:`MERMAID_JS` if it has a diagram.

    The tag goes before the theme's bundle (or before ``</body>`` if there is none); the path is
    relative to the page at ``page_url`` (``pd/`` → ``../assets/…``), so the site works from a
    web server and from the file system alike.
    """
    if _DIAGRAM not in output:
        return output
    tag = f'<script src="{get_relative_url(MERMAID_JS, page_url)}"></script>\n'
    bundle = _THEME_BUNDLE.search(output)
    at = bundle.start() if bundle else output.rindex("</body>")
    return output[:at] + tag + output[at:]


def on_post_page(output: str, *, page: Any, **kwargs: Any) -> str:
    return mermaid_script(output, page.url)

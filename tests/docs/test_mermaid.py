"""Every mermaid diagram in ``docs/`` renders, with the mermaid the site ships, and offline.

- Each ```` ```mermaid ```` block of ``docs/*.md``, and each one a ``<!-- generate: -->``
  marker produces, is drawn by ``mermaid.render`` in headless chromium with the bundled
  ``docs/assets/mermaid/mermaid.min.js``; a failure names the page, the line and mermaid's error.
  A diagram known to be bad is drawn alongside, and must fail: the check can tell.
- The strict build puts that file on exactly the pages that draw diagrams, and in the built
  site, opened from disk with every host name unresolvable, the theme replaces every diagram
  with a drawing.

chromium comes from Debian (``ensure_chromium.sh`` installs it when it is missing and we are
root). About 8 s per chromium run and 15-20 s for the build on a quiet 2-core machine; with
``KVFRAME_DOCS_SITE`` naming a site built strict from this tree the build is skipped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest

from tests.docs.browser import run_page

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^```mermaid\n(.*?)^```", re.S | re.M)
_BAD = "sequenceDiagram\n    A->>B: prefill; then decode\n"


def _load_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvframe_docs_hooks", DOCS / "_hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOKS = _load_hooks()


class Diagram(NamedTuple):
    where: str  # page:line, and the generating function for a generated one
    source: str


def _diagrams() -> list[Diagram]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(Diagram(f"{page.name}:{line}", m.group(1)))
        for marker in HOOKS._MARKER.finditer(text):
            line = text.count("\n", 0, marker.start()) + 1
            generated = HOOKS._render(marker)
            for m in _FENCE.finditer(generated):
                where = f"{page.name}:{line} ({marker.group(1)}:{marker.group(2)})"
                found.append(Diagram(where, m.group(1)))
    return found


DIAGRAMS = _diagrams()

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"></head><body>
<script src="{mermaid}"></script>
<script type="application/json" id="diagrams">{diagrams}</script>
<script>
mermaid.initialize({{startOnLoad: false}});
(async () => {{
  const sources = JSON.parse(document.getElementById("diagrams").textContent);
  const out = [];
  for (let i = 0; i < sources.length; i++) {{
    try {{
      const {{svg}} = await mermaid.render("kvframe-diagram-" + i, sources[i]);
      out.push(svg.startsWith("<svg") && !svg.includes("Syntax error") ? null : svg.slice(0, 300));
    }} catch (e) {{
      out.push(String((e && e.message) || e));
    }}
  }}
  const pre = document.createElement("pre");
  pre.id = "kvframe-result";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}})();
</script></body></html>
"""


@pytest.fixture(scope="module")
def render_errors(tmp_path_factory: pytest.TempPathFactory) -> list[str | None]:
    """mermaid's error for each of DIAGRAMS then the bad one (``None``: it rendered)."""
    tmp = tmp_path_factory.mktemp("mermaid")
    sources = [d.source for d in DIAGRAMS] + [_BAD]
    page = tmp / "diagrams.html"
    page.write_text(
        _PAGE.format(
            mermaid=(DOCS / HOOKS.MERMAID_JS).as_uri(),
            diagrams=json.dumps(sources).replace("</", "<\\/"),
        )
    )
    errors: list[str | None] = run_page(page.as_uri(), tmp / "profile")
    assert len(errors) == len(sources)
    return errors


def test_the_docs_have_diagrams() -> None:
    # the state machines' diagrams are generated; the request's journey is written by hand
    assert len(DIAGRAMS) >= 9
    assert any("generate" not in d.where and d.where.startswith("pd.md") for d in DIAGRAMS)


@pytest.mark.parametrize("index", range(len(DIAGRAMS)), ids=[d.where for d in DIAGRAMS])
def test_the_diagram_renders(index: int, render_errors: list[str | None]) -> None:
    diagram = DIAGRAMS[index]
    error = render_errors[index]
    assert error is None, (
        f"the mermaid diagram at docs/{diagram.where} does not render:\n{error}\n"
        f"--- its source:\n{diagram.source}"
    )


def test_a_bad_diagram_is_reported(render_errors: list[str | None]) -> None:
    # a ';' ends a statement in a sequence diagram: the message is cut off there
    assert render_errors[-1] is not None
    assert "Parse error" in render_errors[-1]


def test_the_bundled_mermaid_is_the_release() -> None:
    data = (DOCS / HOOKS.MERMAID_JS).read_bytes()
    assert hashlib.sha256(data).hexdigest() == HOOKS.MERMAID_SHA256
    assert f'version:"{HOOKS.MERMAID_VERSION}"'.encode() in data
    assert (DOCS / HOOKS.MERMAID_JS).with_name("LICENSE.txt").read_text().startswith("The MIT")


@pytest.mark.parametrize(
    ("url", "src"),
    [("pd/", "../assets/mermaid/mermaid.min.js"), ("", "assets/mermaid/mermaid.min.js")],
)
def test_the_hook_adds_mermaid_before_the_bundle_on_pages_with_diagrams(url: str, src: str) -> None:
    bundle = '<script src="assets/javascripts/bundle.x.min.js"></script>'
    page = f'<body><pre class="mermaid"><code>graph TD</code></pre>{bundle}</body>'
    out = HOOKS.mermaid_script(page, url)
    assert out.replace(f'<script src="{src}"></script>\n', "", 1) == page
    assert out.index(src) < out.index("bundle.x")
    plain = f"<body><pre><code>graph TD</code></pre>{bundle}</body>"
    assert HOOKS.mermaid_script(plain, url) == plain


_SITE_CHECK = """<!doctype html>
<html><head><meta charset="utf-8"></head><body>
{frames}
<script>
const expected = {expected};
function check() {{
  const out = {{}};
  let settled = true;
  document.querySelectorAll("iframe").forEach((frame, i) => {{
    const doc = frame.contentDocument;
    const page = frame.dataset.page;
    const drawn = doc ? doc.querySelectorAll("div.mermaid").length : 0;
    const local = !!(frame.contentWindow && frame.contentWindow.mermaid
                     && frame.contentWindow.mermaid.render);
    out[page] = {{drawn: drawn, bundled: local}};
    if (drawn < expected[page]) settled = false;
  }});
  let pre = document.getElementById("kvframe-result");
  if (!pre) {{
    pre = document.createElement("pre");
    pre.id = "kvframe-result";
    document.body.appendChild(pre);
  }}
  pre.textContent = JSON.stringify(out);
  if (!settled) setTimeout(check, 250);
}}
window.addEventListener("load", () => setTimeout(check, 250));
</script></body></html>
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built strict from this tree; ``KVFRAME_DOCS_SITE`` names one already built so
    (``./dev test`` builds it just before the tests)."""
    given = os.environ.get("KVFRAME_DOCS_SITE")
    if given:
        assert (Path(given) / "index.html").is_file(), f"KVFRAME_DOCS_SITE={given}: no site there"
        return Path(given)
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "--site-dir", str(out)]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}{proc.stderr}"
    return out


def _pages_with_diagrams(site: Path) -> dict[str, int]:
    pages = {}
    for page in sorted(site.rglob("index.html")):
        n = page.read_text().count('<pre class="mermaid">')
        if n:
            pages[page.parent.relative_to(site).as_posix()] = n
    return pages


def test_the_built_site_loads_the_bundled_mermaid_only_where_it_draws(site: Path) -> None:
    pages = _pages_with_diagrams(site)
    assert sum(pages.values()) == len(DIAGRAMS)
    for page in sorted(site.rglob("index.html")):
        text = page.read_text()
        assert ("mermaid/mermaid.min.js" in text) == ('<pre class="mermaid">' in text), page
    assert (site / HOOKS.MERMAID_JS).read_bytes() == (DOCS / HOOKS.MERMAID_JS).read_bytes()


def test_the_built_site_draws_every_diagram_offline(site: Path, tmp_path: Path) -> None:
    pages = _pages_with_diagrams(site)
    frames = "\n".join(
        f'<iframe data-page="{p}" src="{p}/index.html" width="1000" height="800"></iframe>'
        for p in pages
    )
    check = site / "kvframe-check.html"
    check.write_text(_SITE_CHECK.format(frames=frames, expected=json.dumps(pages)))
    seen: dict[str, Any] = run_page(check.as_uri(), tmp_path / "profile")
    for page, diagrams in pages.items():
        assert seen[page]["bundled"], f"{page}: the page has no mermaid of its own"
        assert seen[page]["drawn"] == diagrams, (
            f"{page}: the theme drew {seen[page]['drawn']} of its {diagrams} diagrams offline"
        )

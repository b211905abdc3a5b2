"""The documentation site: it builds strictly, its Python code runs, and its home page renders.

* ``mkdocs build --strict`` (what ``make docs`` runs) into a temporary folder: a broken link, nav
  entry, anchor, snippet include or API reference fails it.
* Every ```` ```python ```` block of every page runs, the blocks of a page in order in one namespace
  that starts with ``import kiln, torch`` and ``from torch import nn`` (docs/index.md says so), in
  a temporary working directory with the repository's root on ``sys.path``. Markers, on the line
  right above a block:
  ``<!-- no-run: why -->`` compiles it only (for GPUs, several nodes, missing data; few);
  ``<!-- run: kiln run -n N -->`` runs it as a script on N processes.
  A block titled ``"... (before)"`` is a peer framework's code in a migration guide (compiled
  only), and a block of ``--8<-- "path:section"`` lines includes a tested script's section.
* The home page, served on 127.0.0.1, is screenshotted by headless Chromium and must show the
  theme's header bar and text. Skipped without ``/usr/bin/chromium`` unless ``KILN_TEST_REQUIRE``
  names ``chromium``; ``KILN_DOCS_SCREENSHOT=path`` keeps a copy of the screenshot.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest
import torch

from distributed import ROOT, check, kiln_run

DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
PRELUDE = "import kiln, torch\nfrom torch import nn\n"
FENCE = re.compile(
    r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S
)
PEER = re.compile(r'title="[^"]*\(before\)"')  # a peer's code in a migration guide: compiled, not run
INCLUDE = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<section>\w+))?"$')  # pymdownx.snippets
NO_RUN = re.compile(r"<!--\s*no-run:\s*(?P<why>.*?)\s*-->\s*\Z")
RUN_AS = re.compile(r"<!--\s*run:\s*kiln run -n (?P<n>\d+)\s*-->\s*\Z")  # a script for n processes
MAX_NO_RUN = 12  # blocks that need GPUs, several processes or several nodes; each says why


def _required(name: str) -> bool:
    return name in os.environ.get("KILN_TEST_REQUIRE", "").split(",")


def code_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line of the block's first code line, code, how to run it) of each python block.

    How: None (in the page's namespace), "no-run: why" (compile only), "processes: n" (a script
    run by ``kiln run -n n``), "peer" (another framework's code: compile only) or "include: path"
    (a file's section, included by pymdownx.snippets; the file is tested where it lives).
    """
    blocks = []
    for match in FENCE.finditer(text):
        if match["lang"] not in ("python", "py"):
            continue
        indent = len(match["indent"])
        code = "".join(line[indent:] + "\n" for line in match["body"].splitlines())
        before = text[: match.start()].rstrip("\n")
        last = before.splitlines()[-1] if before else ""
        skip, script = NO_RUN.search(last), RUN_AS.search(last)
        how = f"no-run: {skip['why']}" if skip else f"processes: {script['n']}" if script else None
        if PEER.search(match["info"]):
            how = "peer"
        lines = [line.strip() for line in code.splitlines() if line.strip() and not line.strip().startswith("#")]
        included = [INCLUDE.match(line) for line in lines]
        if included and all(included):
            how = "include: " + " ".join(f"{m['path']}:{m['section'] or ''}" for m in included if m)
        blocks.append((text.count("\n", 0, match.start()) + 2, code, how))
    return blocks


def _all_blocks():
    return [(page, *block) for page in PAGES for block in code_blocks((DOCS / page).read_text())]


def test_code_block_extraction_finds_indented_blocks_and_markers():
    text = "x\n<!-- no-run: needs GPUs -->\n```python\na = 1\n```\n\n* item\n\n    ```python\n    b = 2\n    ```\n"
    assert code_blocks(text) == [(4, "a = 1\n", "no-run: needs GPUs"), (10, "b = 2\n", None)]
    assert code_blocks("<!-- run: kiln run -n 2 -->\n```python\nc = 3\n```\n") == [(3, "c = 3\n", "processes: 2")]
    peer = '```python title="Composer (before)"\nimport composer\n```\n```python title="kiln (after)"\n--8<-- "a.py:s"\n```\n'
    assert code_blocks(peer) == [(2, "import composer\n", "peer"), (5, '--8<-- "a.py:s"\n', "include: a.py:s")]


def test_no_run_blocks_are_few_and_say_why():
    skipped = [(page, line, how) for page, line, _, how in _all_blocks() if how and how.startswith("no-run")]
    assert all(how != "no-run: " for _, _, how in skipped), skipped
    assert len(skipped) <= MAX_NO_RUN, f"{len(skipped)} blocks are not run: {skipped}"
    text = "\n".join((DOCS / page).read_text() for page in PAGES)
    assert text.count("<!-- no-run:") == len(skipped), "a no-run marker must sit right above a python block"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", [p for p in PAGES if code_blocks((DOCS / p).read_text())])
def test_page_code_runs(page, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.syspath_prepend(str(ROOT))  # pages name examples.* modules, as from the repository's root
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only contend
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(PRELUDE, "<prelude>", "exec"), namespace)
    for line, code, how in code_blocks((DOCS / page).read_text()):
        compiled = compile("\n" * (line - 1) + code, str(DOCS / page), "exec")  # tracebacks name the page line
        if how is None:
            exec(compiled, namespace)
        elif how.startswith("include: "):
            for spec in how.split()[1:]:
                path, section = spec.split(":")
                text = (ROOT / path).read_text()
                assert not section or f"[start:{section}]" in text and f"[end:{section}]" in text, spec
        elif how.startswith("processes: "):
            script = tmp_path / f"{Path(page).stem}_line{line}.py"
            script.write_text("\n" * (line - 1) + code)
            check(kiln_run(script, nproc=int(how.split()[-1]), cwd=tmp_path, timeout=120))


# --- the site -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if not _required("mkdocs"):
        pytest.importorskip("mkdocs")
        pytest.importorskip("mkdocstrings")
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return out


def test_site_builds_strictly_with_every_page_and_the_api_reference(site):
    for page in PAGES:  # x.md -> x/index.html; index.md and README.md -> index.html of their folder
        folder = page[: -len(".md")].removesuffix("index").removesuffix("README")
        assert (site / folder / "index.html").is_file(), f"{page} was not built"
    api = (site / "api" / "trainer" / "index.html").read_text()
    assert 'id="kiln.trainer.trainer.Trainer"' in api and "max_duration" in api  # rendered from the docstring


def test_readme_links_point_at_files():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links no local file"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links missing files: {missing}"


# --- the home page in headless Chromium -------------------------------------------------------------


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced RGB or RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks, header = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
    assert header is not None
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, f"unsupported PNG {header}"
    bpp = 3 if colour == 2 else 4
    raw, stride, rows, prev = zlib.decompress(b"".join(chunks)), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i] for i in range(len(r)) if bpp == 3 or i % 4 != 3) for r in rows]


CHROMIUM = Path("/usr/bin/chromium")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 -- the base class's signature
        pass


@pytest.mark.timeout(240)
def test_docs_home_page_screenshot_in_headless_chromium(site, tmp_path):
    if not CHROMIUM.exists():
        if _required("chromium"):
            pytest.fail("KILN_TEST_REQUIRE names chromium but /usr/bin/chromium is missing: apt-get install chromium")
        pytest.skip("needs /usr/bin/chromium (Debian's chromium package)")
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    shot = tmp_path / "home.png"
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
        cmd += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
        cmd += ["--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}"]
        cmd += ["--window-size=1280,900", "--virtual-time-budget=5000", url]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    assert shot.is_file(), f"no screenshot (exit {result.returncode}):\n{result.stderr[-3000:]}"
    if os.environ.get("KILN_DOCS_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["KILN_DOCS_SCREENSHOT"])
    width, height, rows = read_png(shot.read_bytes())
    assert (width, height) == (1280, 900)
    pixels = [row[i : i + 3] for row in rows[::4] for i in range(0, len(row), 12)]
    assert len(set(pixels)) >= 30, f"the page looks blank: {len(set(pixels))} colours"
    # The theme's stylesheet loaded: Material's deep-orange header bar spans the top of the page.
    header = [row[i : i + 3] for row in rows[5:40] for i in range(0, len(row), 3)]
    orange = sum(1 for r, g, b in header if r > 220 and 70 < g < 150 and b < 110)  # #ff6e42 here
    assert orange > 0.5 * len(header), f"no header bar: {orange} of {len(header)} top pixels are orange"
    # Text rendered: dark pixels in the body below the header.
    body = [p for row in rows[120:800:4] for p in (row[i : i + 3] for i in range(0, len(row), 12))]
    assert sum(1 for p in body if max(p) < 100) > 50, "no dark text in the page body"

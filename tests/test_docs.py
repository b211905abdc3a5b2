"""The documentation site: it builds strictly, its code runs as written, and its home page renders.

* ``mkdocs build --strict`` (what ``make docs`` runs) into a temporary folder: a broken link, nav
  entry, anchor, snippet include or API reference fails it.
* Every ```` ```python ```` block of every page runs **alone, as a file**: in a fresh namespace
  (``__name__ == "__main__"``), in a fresh temporary working directory, with the repository's root
  and ``examples/`` on ``sys.path``. So a block carries its own imports and builds what it uses.
  Markers, on the line right above a block:
  ``<!-- no-run: why -->`` compiles it only (for GPUs, several nodes, missing data; few);
  ``<!-- run: kiln run -n N -->`` runs it as a script on N processes;
  ``<!-- continues: why -->`` marks a deliberate fragment: it runs in the namespace and working
  directory the block above it left (a page's walk-through: save, then resume; few).
  A block titled ``"... (before)"`` is a peer framework's code in a migration guide (compiled
  only), and a block of ``--8<-- "path:section"`` lines includes a tested script's section.
  Every block, run or compiled, is also checked for names it neither defines nor imports
  (ruff's F821 over the block and the blocks it continues).
* Every ```` ```yaml ```` block is read by kiln's config loader (``load_trainer_args``, what
  ``kiln train`` reads before anything runs: fields, types, batch arithmetic, imports, constructor
  arguments). ``<!-- yaml: on top of FILE -->`` marks an excerpt of a run file: it is merged onto
  FILE first. An included file is loaded as it is; a peer's ``(before)`` file is not.
* Every line of a ```` ```bash ```` / ```` ```sh ```` block (README.md's too) that starts with ``kiln `` is parsed by
  kiln's own parser (:func:`kiln.cli.main.parse_args`), shell variables replaced by
  ``SHELL_VALUES``; a ``kiln train -f FILE`` or ``kiln plan -f FILE`` line also loads FILE with
  its dotted overrides for its world size, and a script under ``examples/`` must exist.
* The home page, served on 127.0.0.1, is screenshotted by headless Chromium and must show the
  theme's header bar and text. Skipped without ``/usr/bin/chromium`` unless ``KILN_TEST_REQUIRE``
  names ``chromium``; ``KILN_DOCS_SCREENSHOT=path`` keeps a copy of the screenshot.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from distributed import ROOT, check, fork_run

DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
FENCE = re.compile(
    r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S
)
PEER = re.compile(r'title="[^"]*\(before\)"')  # a peer's code in a migration guide: compiled, not run
INCLUDE = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<section>\w+))?"$')  # pymdownx.snippets
MARKER = re.compile(r"<!--\s*(?P<kind>no-run|run|continues|yaml):\s*(?P<why>.*?)\s*-->\s*\Z")
RUN_AS = re.compile(r"kiln run -n (?P<n>\d+)")  # <!-- run: kiln run -n N -->: a script for N processes
YAML_BASE = re.compile(r"on top of (?P<path>\S+)")  # <!-- yaml: on top of examples/x.yaml -->
PYTHON, YAML, SHELL = ("python", "py"), ("yaml", "yml"), ("bash", "sh", "shell")
MAX_NO_RUN = 12  # blocks that need GPUs, several processes or several nodes; each says why
MAX_CONTINUES = 8  # fragments of a walk-through; each says why
SHELL_VALUES = {"NODE_RANK": "0"}  # what $VAR stands for when a documented command is parsed


def _required(name: str) -> bool:
    return name in os.environ.get("KILN_TEST_REQUIRE", "").split(",")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it is, its language, its code and how it is tested."""

    page: str
    line: int  # the block's first code line, 1-based
    lang: str
    code: str
    how: str | None  # python: None (runs alone), "continues: why", "no-run: why", "processes: n",
    # "peer", "include: path:section ..."; yaml: None, "base: path", "peer", "include: path"

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(page: str, text: str) -> list[Block]:
    """Every fenced block of ``text`` (indented ones too) with the marker on the line above it."""
    blocks = []
    for match in FENCE.finditer(text):
        indent = len(match["indent"])
        code = "".join(line[indent:] + "\n" for line in match["body"].splitlines())
        before = text[: match.start()].rstrip("\n")
        marker = MARKER.search(before.splitlines()[-1] if before else "")
        how = None
        if marker:
            kind, why = marker["kind"], marker["why"]
            if kind == "run":
                run_as = RUN_AS.fullmatch(why)
                how = f"processes: {run_as['n']}" if run_as else f"run: {why}"
            elif kind == "yaml":
                base = YAML_BASE.fullmatch(why)
                how = f"base: {base['path']}" if base else f"yaml: {why}"
            else:
                how = f"{kind}: {why}"
        if PEER.search(match["info"]):
            how = "peer"
        lines = [line.strip() for line in code.splitlines() if line.strip() and not line.strip().startswith("#")]
        included = [INCLUDE.match(line) for line in lines]
        if included and all(included):
            how = "include: " + " ".join(f"{m['path']}:{m['section'] or ''}" for m in included if m)
        line = text.count("\n", 0, match.start()) + 2
        blocks.append(Block(page, line, match["lang"], code, how))
    return blocks


def code_blocks(text: str, langs: tuple[str, ...] = PYTHON, page: str = "") -> list[Block]:
    return [b for b in page_blocks(page, text) if b.lang in langs]


@functools.cache
def _all_blocks() -> list[Block]:
    return [b for page in PAGES for b in page_blocks(page, (DOCS / page).read_text())]


def _chains() -> list[list[Block]]:
    """The python blocks that run, each with the fragments that continue it."""
    chains: list[list[Block]] = []
    previous: Block | None = None
    for block in _all_blocks():
        if block.lang not in PYTHON:
            continue
        if block.how is not None and block.how.startswith("continues: "):
            assert previous is not None and previous.page == block.page, f"{block.id} continues no block above it"
            assert previous.how is None or previous.how.startswith("continues: "), (
                f"{block.id} continues {previous.id}, which does not run ({previous.how})"
            )
            chains[-1].append(block)
        elif block.how is None:
            chains.append([block])
        previous = block
    return chains


def test_block_extraction_finds_indented_blocks_languages_and_markers():
    text = "x\n<!-- no-run: needs GPUs -->\n```python\na = 1\n```\n\n* item\n\n    ```python\n    b = 2\n    ```\n"
    assert code_blocks(text) == [
        Block("", 4, "python", "a = 1\n", "no-run: needs GPUs"),
        Block("", 10, "python", "b = 2\n", None),
    ]
    assert code_blocks("<!-- run: kiln run -n 2 -->\n```python\nc = 3\n```\n")[0].how == "processes: 2"
    assert code_blocks("<!-- continues: the run above -->\n```py\nd\n```\n")[0].how == "continues: the run above"
    peer = '```python title="Composer (before)"\nimport composer\n```\n```python title="kiln (after)"\n--8<-- "a.py:s"\n```\n'
    assert [b.how for b in code_blocks(peer)] == ["peer", "include: a.py:s"]
    yaml_text = "<!-- yaml: on top of examples/mlp.yaml -->\n```yaml\nseed: 1\n```\n```bash\nkiln run -n 2 x.py\n```\n"
    assert [(b.lang, b.how) for b in page_blocks("p", yaml_text)] == [
        ("yaml", "base: examples/mlp.yaml"),
        ("bash", None),
    ]


def test_markers_are_few_say_why_and_sit_on_a_block():
    blocks = _all_blocks()
    for kind, limit in (("no-run", MAX_NO_RUN), ("continues", MAX_CONTINUES)):
        marked = [(b.id, b.how) for b in blocks if b.how and b.how.startswith(f"{kind}: ")]
        assert all(how != f"{kind}: " for _, how in marked), f"a {kind} marker without a reason: {marked}"
        assert len(marked) <= limit, f"{len(marked)} blocks are marked {kind}: {marked}"
    unknown = [(b.id, b.how) for b in blocks if b.how and b.how.split(":")[0] in ("run", "yaml")]
    assert not unknown, f"markers this test does not know: {unknown}"
    text = "\n".join((DOCS / page).read_text() for page in PAGES)
    markers = len(re.findall(r"<!--\s*(?:no-run|run|continues|yaml):", text))
    assert markers == sum(
        1 for b in blocks if b.how and b.how.split(":")[0] in ("no-run", "processes", "continues", "base")
    )
    assert markers, "no markers found: the marker pattern is wrong"
    _chains()  # every fragment continues a block that runs


def _run_block(block: Block, namespace: dict, folder: Path) -> None:
    path = folder / f"{Path(block.page).stem}_line{block.line}.py"
    path.write_text(block.code)
    namespace["__file__"] = str(path)
    # the page's line numbers in tracebacks, and the page's name
    exec(compile("\n" * (block.line - 1) + block.code, str(DOCS / block.page), "exec"), namespace)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("chain", _chains(), ids=lambda chain: chain[0].id)
def test_python_block_runs_alone(chain, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.syspath_prepend(str(ROOT))  # pages name examples.* modules, as from the repository's root
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only contend
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    namespace: dict = {"__name__": "__main__"}  # one namespace for a block and the fragments continuing it
    for block in chain:
        _run_block(block, namespace, tmp_path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "block", [b for b in _all_blocks() if b.how and b.how.startswith("processes: ")], ids=lambda b: b.id
)
def test_python_script_block_runs_on_several_processes(block, tmp_path):
    script = tmp_path / f"{Path(block.page).stem}_line{block.line}.py"
    script.write_text("\n" * (block.line - 1) + block.code)
    check(fork_run(script, nproc=int(block.how.split()[-1]), cwd=tmp_path, timeout=240))


def test_included_sections_exist():
    for block in _all_blocks():
        if block.how and block.how.startswith("include: "):
            for spec in block.how.split()[1:]:
                path, section = spec.split(":")
                text = (ROOT / path).read_text()
                assert not section or f"[start:{section}]" in text and f"[end:{section}]" in text, (block.id, spec)


def test_python_blocks_name_nothing_they_do_not_define_or_import(tmp_path):
    """ruff's undefined-name check over every python block (with the blocks it continues), the
    compiled-only ones too: a missing import fails here even in a branch that does not run."""
    try:
        import ruff  # noqa: F401 -- only to know it is installed
    except ImportError:
        if _required("ruff"):
            pytest.fail("KILN_TEST_REQUIRE names ruff, so this must run: ruff is not installed (the dev extra)")
        pytest.skip("needs ruff (the dev extra)")
    files: dict[str, list[Block]] = {}
    pending: list[Block] = []
    for block in _all_blocks():
        if block.lang not in PYTHON or (block.how or "").startswith(("peer", "include")):
            continue
        if not (block.how or "").startswith("continues: "):
            pending = []
        pending = [*pending, block]
        name = f"{block.page.replace('/', '__')[:-3]}_line{block.line}.py"
        (tmp_path / name).write_text("".join(b.code for b in pending))
        files[name] = pending
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "--select", "F821",
         "--output-format", "json", "--target-version", "py310", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr
    missing: dict[str, set[str]] = {}
    for d in json.loads(result.stdout):
        missing.setdefault(files[Path(d["filename"]).name][-1].id, set()).add(d["message"].split("`")[1])
    problems = [f"{where}: {', '.join(sorted(names))}" for where, names in sorted(missing.items())]
    assert not problems, "blocks use names they neither import nor define:\n" + "\n".join(problems)
    assert len(files) > 60  # every page's blocks were looked at


# --- YAML blocks and kiln command lines --------------------------------------------------------------


def _yaml_blocks() -> list[Block]:
    return [b for b in _all_blocks() if b.lang in YAML and b.how != "peer"]


def _merge(base: dict, part: dict) -> dict:
    merged = dict(base)
    for key, value in part.items():
        merged[key] = (
            _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def _load_run_file(config, overrides=(), world_size: int = 1):
    """What ``kiln train`` reads first, for a world of ``world_size``; skips without an optional package."""
    from kiln.config.args import load_trainer_args

    try:
        return load_trainer_args(config, list(overrides), world_size=world_size)
    except ModuleNotFoundError as e:  # an optional package the run file names (transformers)
        package = (e.name or "").partition(".")[0]
        if _required(package):  # `make test` names it: a skip here would hide a run file never loaded
            pytest.fail(f"KILN_TEST_REQUIRE names {package}, so this run file must load: {e}")
        pytest.skip(f"needs {e.name}")


def test_a_run_file_needing_a_missing_package_skips_unless_kiln_test_require_names_it(monkeypatch):
    import kiln.config.args

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr(kiln.config.args, "load_trainer_args", missing)
    monkeypatch.setenv("KILN_TEST_REQUIRE", "torchao,ruff")
    with pytest.raises(pytest.skip.Exception) as skipped:
        _load_run_file({})
    assert str(skipped.value) == "needs transformers"
    monkeypatch.setenv("KILN_TEST_REQUIRE", "torchao,transformers,ruff")
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as failed:  # a skip must not pass
        _load_run_file({})
    assert failed.type is pytest.fail.Exception and str(failed.value) == (
        "KILN_TEST_REQUIRE names transformers, so this run file must load: No module named 'transformers'"
    )


@pytest.mark.parametrize("block", _yaml_blocks(), ids=lambda b: b.id)
def test_yaml_block_is_a_run_file_kilns_loader_accepts(block, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a run file's relative paths must not need (or create) anything here
    monkeypatch.syspath_prepend(str(ROOT))
    if block.how and block.how.startswith("include: "):
        config = yaml.safe_load((ROOT / block.how.split()[1].split(":")[0]).read_text())
    else:
        config = yaml.safe_load(block.code)
        if block.how and block.how.startswith("base: "):
            config = _merge(yaml.safe_load((ROOT / block.how.split()[1]).read_text()), config)
    cc = config.get("compute_config") or {}
    # what it is for: a model replica's ranks, times the expert-parallel ranks (taken from dp_shard)
    world = cc.get("runtime_ngpus") or (cc.get("plan_ngpus") or cc.get("tp", 1) * cc.get("pp", 1)) * cc.get("ep", 1)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = _load_run_file(config, world_size=world)
    assert args.model.type, block.id
    assert os.listdir(tmp_path) == [], "loading a run file wrote files"


def _kiln_lines() -> list[tuple[Block, str]]:
    lines = []
    readme = page_blocks("../README.md", (ROOT / "README.md").read_text())  # its commands too
    for block in [*_all_blocks(), *readme]:
        if block.lang not in SHELL:
            continue
        joined = block.code.replace("\\\n", " ")  # continuation lines
        lines += [(block, line.strip()) for line in joined.splitlines() if line.strip().startswith("kiln ")]
    return lines


def _shell_words(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    for i, word in enumerate(words):
        for name in re.findall(r"\$\{?(\w+)\}?", word):
            assert name in SHELL_VALUES, f"{line!r}: ${name} has no value in SHELL_VALUES"
            word = re.sub(rf"\$\{{?{name}\}}?", SHELL_VALUES[name], word)
        words[i] = word
    return words[1:]


@pytest.mark.parametrize("line", _kiln_lines(), ids=lambda item: f"{item[0].id}:{item[1][:60]}")
def test_kiln_command_line_parses(line, monkeypatch):
    from kiln.cli.main import parse_args

    block, command = line
    monkeypatch.chdir(ROOT)  # documented paths are relative to the repository's root
    monkeypatch.syspath_prepend(str(ROOT))
    argv = _shell_words(command)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            args = parse_args(argv)
    except SystemExit as e:
        assert e.code == 0, f"{block.id}: `{command}` does not parse:\n{out.getvalue()}"
        assert "usage: kiln" in out.getvalue() or out.getvalue().startswith("kiln ")  # --help, --version
        return
    assert args.command is not None, command
    script = getattr(args, "script", None)
    if script and script.startswith("examples/") and not getattr(args, "module", False):
        assert (ROOT / script).is_file(), f"{block.id}: `{command}` runs {script}, which does not exist"
    if args.command in ("train", "plan") and getattr(args, "file", None):
        world = getattr(args, "world_size", None) or int(getattr(args, "nproc_per_node", None) or 1)
        _load_run_file(args.file, getattr(args, "extra", ()), world_size=world)


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


def test_getting_started_installs_torch_for_the_machine_before_kiln():
    # `pip install -e .` into an environment without torch pulls PyPI's CUDA build (5.5 GB), GPU or not
    text = (DOCS / "getting_started.md").read_text()
    section = text.split("## Installing into your own environment", 1)[1].split("\n## ", 1)[0]
    pips = [
        line.split("#")[0].strip()
        for block in code_blocks(section, SHELL)
        for line in block.code.splitlines()
        if line.startswith("pip install")
    ]
    assert pips[:3] == [
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
        "pip install torch==2.13.0",
        "pip install -e .",
    ]
    assert "--index-url https://download.pytorch.org/whl/cpu" in section.split("```")[-1]  # for make's .venv too


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

"""The docs' examples still run, and the docs hold together.

Every ```console block of README.md and docs/*.md is a transcript: lines starting with ``$ ``
are commands (a trailing ``\\`` continues one on the next line), the lines after a command are
what it printed (stdout and stderr, in order). The conventions:

- A page's blocks run in order, in one fresh empty directory, so a page sets itself up in the
  open (``$ k3ckpt synth Kimi-K3`` first) and later blocks use what earlier ones made.
- ``<!-- no-test: REASON -->`` on the line before a block (blank lines allowed between) skips
  it, with that reason: a real hub, a GPU, an engine.
- ``<!-- docs-test: k3-full -->`` there instead marks a block at K3 scale: it runs with
  ``k3-full`` (``k3ckpt synth k3-full --preset k3-full --headers-only``, ~10 s, made once per
  session and hard-linked into the page's directory) in the ``slow`` test
  ``test_k3_scale_examples_run`` and when recording, not in ``test_examples_run``. It may use
  ``k3-full`` and what earlier K3-scale blocks of its page made, nothing else.
- ``<!-- docs-test: serve PRESET as OWNER/NAME -->`` on a line of a page: before its blocks run,
  ``k3ckpt synth PRESET`` is served on a loopback hub (:mod:`k3ckpt.testing.hub`) as that repo,
  with ``HF_ENDPOINT`` / ``MODELSCOPE_ENDPOINT`` pointing at it - what the page's output was
  recorded against. The synthetic checkpoint lives outside the page's directory.
- ``$EXAMPLES`` is the repository's ``examples/`` directory (the recipes' scripts).
- A command must exit 0, unless the block continues with ``$ echo $?`` and the code it expects.
- Each shown output line (blank lines and ``...`` skipped) must appear in what the command
  printed, in order, after both are normalized: the working directory, the hub's address,
  rates, durations, key ids and the machine-dependent preflight rows (disk, memory, GPU, read
  speed) are masked. A renamed option, a removed command or a changed message fails here.

Record or refresh a page's output (runs in /tmp/docs-work/<page>, the path the docs show)::

    python tests/test_docs.py docs/inspect.md            # print each command's real output
    python tests/test_docs.py --write docs/inspect.md    # and fill in outputs that no longer match
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from k3ckpt.testing.hub import LoopbackHub

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Where pages are recorded; the docs' output shows paths under it.
RECORD_ROOT = Path("/tmp/docs-work")
README_LIMIT = 12 * 1024

#: Digest of the code that writes the served synthetic checkpoints.
SYNTH_DIGEST = hashlib.sha256(
    b"".join(p.read_bytes() for p in sorted((ROOT / "k3ckpt" / "testing" / "synth").glob("*.py")))).hexdigest()[:12]
NO_TEST = re.compile(r"^\s*<!--\s*no-test:\s*(.*?)\s*-->\s*$")
K3_FULL = re.compile(r"^\s*<!--\s*docs-test:\s*k3-full\s*-->\s*$")
#: The name a K3-scale block finds the full inventory under, in the page's directory.
K3_FULL_NAME = "k3-full"
SERVE = re.compile(r"^\s*<!--\s*docs-test:\s*serve\s+(\S+)\s+as\s+(\S+)\s*-->\s*$", re.MULTILINE)
FENCE = re.compile(r"^```(\S*)\s*$")

_MASKS = [
    (re.compile(re.escape(str(RECORD_ROOT)) + r"/[\w.-]+"), "<dir>"),
    (re.compile(r"https?://127\.0\.0\.1:\d+"), "<hub>"),
    (re.compile(r"\d[\d,.]*\s?[KMGT]?i?B/s"), "<rate>"),
    (re.compile(r"(?<![\w.])\d+(\.\d+)?\s?s\b"), "<secs>"),
    (re.compile(r"ed25519:[0-9a-f]{16}"), "ed25519:<key>"),
    # preflight's tally: WARN/PASS move with the machine's GPUs (FAIL counts stay checked)
    (re.compile(r"\b\d+ (WARN|PASS)\b"), r"<n> \1"),
]
#: Preflight rows whose numbers belong to the machine, not to the checkpoint.
_MACHINE_ROW = re.compile(r"^(PASS|WARN|FAIL)(\s+)(disk|host memory|gpu|mxfp4|read speed)\b.*$")


@dataclass
class Command:
    text: str
    line: int
    output: list[str] = field(default_factory=list)
    rc: int = 0


@dataclass
class Block:
    line: int
    commands: list[Command]
    skip: str | None
    end: int  # index of the closing fence line
    k3_full: bool = False  # runs only with the full K3 inventory (``<!-- docs-test: k3-full -->``)


@dataclass
class Page:
    path: Path
    blocks: list[Block]
    serve: tuple[str, str] | None


def parse(path: Path) -> Page:
    lines = path.read_text(encoding="utf-8").splitlines()
    serve_m = SERVE.search("\n".join(lines))
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        lang, start = m.group(1), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if lang == "console":
            k = start - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            skip_m = NO_TEST.match(lines[k]) if k >= 0 else None
            blocks.append(Block(start + 1, _commands(lines[start + 1:j], start + 2),
                                skip_m.group(1) if skip_m else None, j, k >= 0 and bool(K3_FULL.match(lines[k]))))
        i = j + 1
    return Page(path, blocks, (serve_m.group(1), serve_m.group(2)) if serve_m else None)


def _commands(body: list[str], first_line: int) -> list[Command]:
    cmds: list[Command] = []
    i = 0
    while i < len(body):
        line = body[i]
        if line.startswith("$ "):
            text, start = line[2:], first_line + i
            while text.endswith("\\") and i + 1 < len(body):
                i += 1
                text = text + "\n" + body[i]
            if text.strip() == "echo $?" and cmds:
                i += 1
                code = body[i].strip() if i < len(body) else ""
                if not code.isdigit():
                    raise ValueError(f"line {start}: `echo $?` is not followed by an exit code")
                cmds[-1].rc = int(code)
            else:
                cmds.append(Command(text, start))
        elif cmds:
            cmds[-1].output.append(line)
        i += 1
    return cmds


def normalize(line: str, cwd: Path) -> str:
    line = line.replace(str(cwd), "<dir>")
    for pattern, repl in _MASKS:
        line = pattern.sub(repl, line)
    m = _MACHINE_ROW.match(line)
    if m:
        line = f"{m.group(1)}{m.group(2)}{m.group(3)}"
    return line.rstrip()


def missing_lines(expected: list[str], actual: list[str], cwd: Path) -> list[str]:
    """The expected lines not found, in order, among the actual ones (both normalized)."""
    want = [normalize(x, cwd) for x in expected if x.strip() and x.strip() != "..."]
    have = [normalize(x, cwd) for x in actual]
    missing, pos = [], 0
    for w in want:
        try:
            pos = have.index(w, pos) + 1
        except ValueError:
            missing.append(w)
    return missing


def _env(scratch: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("K3CKPT_", "HF_", "MODELSCOPE_", "RANK", "WORLD_SIZE", "LOCAL_", "SLURM_"))
           and k not in ("GROUP_RANK", "JOB_COMPLETION_INDEX")}
    env.update({
        "PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
        "K3CKPT_CACHE_DIR": str(scratch / "cache"),
        "HF_HOME": str(scratch / "hf-home"),
        "MODELSCOPE_CACHE": str(scratch / "ms-cache"),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "COLUMNS": "100",
        "EXAMPLES": str(ROOT / "examples"),
    })
    env.update(extra)
    return env


@dataclass
class Result:
    block: Block
    command: Command
    rc: int
    output: list[str]

    def problems(self, cwd: Path) -> list[str]:
        out = []
        where = f"line {self.command.line}: $ {self.command.text}"
        if self.rc != self.command.rc:
            out.append(f"{where}\n  exit code {self.rc}, the docs say {self.command.rc}")
        miss = missing_lines(self.command.output, self.output, cwd)
        if miss:
            out.append(f"{where}\n  not printed: " + "\n  not printed: ".join(miss))
        if out:
            out[-1] += "\n  it printed:\n    " + "\n    ".join(self.output[-40:])
        return out


class Hubs:
    """Loopback hubs serving synthetic checkpoints, started on first use and shared."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self._hubs: dict[tuple[str, str], LoopbackHub] = {}
        self._lock = threading.Lock()

    def env(self, preset: str, repo: str) -> dict[str, str]:
        with self._lock:
            if (preset, repo) not in self._hubs:
                # named by synth's source: a recording scratch outlives a change to what synth
                # writes, and must not serve the stale checkpoint
                src = self.scratch / f"hub-{preset}-{SYNTH_DIGEST}"
                if not (src / "config.json").exists():
                    subprocess.run(["k3ckpt", "synth", str(src), "--preset", preset, "--force"], check=True,
                                   env=_env(self.scratch, {}), stdout=subprocess.DEVNULL)
                hub = LoopbackHub({repo: src}, cache_dir=self.scratch / "hub-cache")
                self._hubs[(preset, repo)] = hub.start()
            return self._hubs[(preset, repo)].env_vars()

    def close(self) -> None:
        for hub in self._hubs.values():
            hub.stop()
        self._hubs.clear()


def link_tree(src: Path, dest: Path) -> None:
    """``cp -al``: ``dest`` a new directory of hard links to ``src``'s files (same filesystem).
    Not a symlink: commands print the paths they open resolved, and ``k3-full`` must print as
    itself. Never a copy: the headers-only files are sparse, 1.56 TB in all."""
    for path in sorted(src.rglob("*")):
        target = dest / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)


def run_page(page: Page, scratch: Path, cwd: Path, hubs: Hubs | None = None, *, k3_full: Path | None = None,
             only_k3_full: bool = False) -> Iterator[Result]:
    """Run a page's testable blocks in ``cwd`` (made empty); ``scratch`` holds caches (and the
    hub's checkpoint when no shared ``hubs`` are given). K3-scale blocks run only given
    ``k3_full`` (linked into ``cwd`` as ``k3-full``); ``only_k3_full``: run only them."""
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    scratch.mkdir(parents=True, exist_ok=True)
    if k3_full is not None and any(b.k3_full for b in page.blocks):
        link_tree(k3_full, cwd / K3_FULL_NAME)
    own = hubs is None and page.serve is not None
    if own:
        hubs = Hubs(scratch)
    try:
        extra = hubs.env(*page.serve) if hubs is not None and page.serve else {}
        env = _env(scratch, extra)
        for block in page.blocks:
            if block.skip is not None or (block.k3_full and k3_full is None) or (only_k3_full and not block.k3_full):
                continue
            for cmd in block.commands:
                proc = subprocess.run(["bash", "-c", cmd.text], check=False, cwd=cwd, env=env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, timeout=300)
                yield Result(block, cmd, proc.returncode, proc.stdout.splitlines())
    finally:
        if own and hubs is not None:
            hubs.close()


# -- the tests ---------------------------------------------------------------------------------


def _page_id(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.fixture(scope="module")
def hubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hubs]:
    h = Hubs(tmp_path_factory.mktemp("hubs"))
    yield h
    h.close()


def _page_problems(path: Path, root: Path, hubs: Hubs) -> list[str]:
    cwd = root / "page"
    problems: list[str] = []
    for res in run_page(parse(path), root / "scratch", cwd, hubs):
        problems += res.problems(cwd)
    return problems


@pytest.fixture(scope="module")
def page_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              hubs: Hubs) -> Iterator[dict[Path, Future[list[str]]]]:
    """The selected pages run side by side (each in its own directory): half the wall time."""
    selected = [item.callspec.params["path"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_examples_run" and hasattr(item, "callspec")]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        yield {p: pool.submit(_page_problems, p, tmp_path_factory.mktemp(p.stem), hubs) for p in selected}


@pytest.mark.parametrize("path", PAGES, ids=_page_id)
def test_examples_run(path: Path, page_runs: dict[Path, Future[list[str]]]) -> None:
    problems = page_runs[path].result()
    assert not problems, f"{_page_id(path)}:\n" + "\n".join(problems)


def test_every_page_has_something_to_run() -> None:
    for path in PAGES:
        if path.name in ("index.md", "env.md", "api.md", "architecture.md"):  # (test_api, test_architecture)
            continue
        page = parse(path)
        assert any(b.skip is None and b.commands for b in page.blocks), f"{_page_id(path)}: no tested example"


K3_PAGES = [p for p in PAGES if any(b.k3_full for b in parse(p).blocks)]


@pytest.mark.slow
@pytest.mark.parametrize("path", K3_PAGES, ids=_page_id)
def test_k3_scale_examples_run(path: Path, k3_full: Path, tmp_path: Path, hubs: Hubs) -> None:
    """The K3-scale blocks (``<!-- docs-test: k3-full -->``), on the full inventory's headers."""
    cwd = tmp_path / "page"
    problems: list[str] = []
    for res in run_page(parse(path), tmp_path / "scratch", cwd, hubs, k3_full=k3_full, only_k3_full=True):
        problems += res.problems(cwd)
    assert not problems, f"{_page_id(path)}:\n" + "\n".join(problems)


def test_k3_scale_blocks_run_only_with_the_inventory(tmp_path: Path) -> None:
    """A K3-scale block is skipped by the ordinary run and run, alone with ``only_k3_full``,
    against the inventory linked in as ``k3-full`` (here a small stand-in)."""
    doc = tmp_path / "k3.md"
    doc.write_text("```console\n$ echo small\nsmall\n```\n\n<!-- docs-test: k3-full -->\n\n"
                   "```console\n$ cat k3-full/marker\nbig\n```\n", encoding="utf-8")
    page = parse(doc)
    assert [b.k3_full for b in page.blocks] == [False, True] and page.blocks[1].skip is None
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    (inventory / "marker").write_text("big\n")
    cwd = tmp_path / "page"
    assert [r.command.text for r in run_page(page, tmp_path / "scratch", cwd)] == ["echo small"]
    results = list(run_page(page, tmp_path / "scratch", cwd, k3_full=inventory, only_k3_full=True))
    assert [(r.command.text, r.problems(cwd)) for r in results] == [("cat k3-full/marker", [])]
    assert (cwd / "k3-full" / "marker").stat().st_ino == (inventory / "marker").stat().st_ino  # linked


def test_skips_give_a_reason() -> None:
    for path in PAGES:
        for b in parse(path).blocks:
            assert b.skip is None or b.skip.strip(), f"{_page_id(path)}:{b.line}: no-test without a reason"


def test_a_wrong_example_fails(tmp_path: Path) -> None:
    """The runner can fail: a renamed option, a removed command, a wrong exit code, changed output."""
    doc = tmp_path / "bad.md"
    doc.write_text(
        "```console\n$ k3ckpt synth Kimi-K3\nwrote KIMI: 99 shards\n```\n\n"
        "```console\n$ k3ckpt inspect Kimi-K3 --no-such-option\n```\n\n"
        "```console\n$ k3ckpt no-such-command Kimi-K3\n```\n\n"
        "<!-- no-test: never runs -->\n```console\n$ false\n```\n\n"
        "```console\n$ k3ckpt verify Kimi-K3\n$ echo $?\n1\n```\n",
        encoding="utf-8",
    )
    page = parse(doc)
    assert [b.skip for b in page.blocks] == [None, None, None, "never runs", None]
    cwd = tmp_path / "page"
    results = list(run_page(page, tmp_path / "scratch", cwd))
    assert [bool(r.problems(cwd)) for r in results] == [True, True, True, True]
    assert "not printed: wrote KIMI: 99 shards" in results[0].problems(cwd)[0]
    assert "exit code 2, the docs say 0" in results[1].problems(cwd)[0]
    assert "exit code 0, the docs say 1" in results[3].problems(cwd)[0]


KEY_ID = re.compile(r"ed25519:[0-9a-f]{16}")


def test_a_page_names_each_key_it_makes_by_one_id() -> None:
    """Key ids are masked when outputs are compared (each run makes a new key), so nothing else
    sees a page whose verify line names another key than its keygen printed (issue #25): a page
    shows at most one id per ``manifest keygen`` it runs."""
    for path in PAGES:
        commands = [c for b in parse(path).blocks if b.skip is None for c in b.commands]
        keygens = sum("manifest keygen" in c.text for c in commands)
        ids = {m for c in commands for line in c.output for m in KEY_ID.findall(line)}
        assert len(ids) <= keygens, f"{_page_id(path)}: {len(ids)} key ids ({', '.join(sorted(ids))}) for {keygens} keygen(s)"


def test_normalize_masks_only_what_varies() -> None:
    cwd = Path("/tmp/x/page")
    a = "ok: /tmp/x/page/K (full; reference: none): 15 files, 4 hashed (3.05 MB at 43.52 MB/s), 0.1 s"
    b = "ok: /tmp/docs-work/inspect/K (full; reference: none): 15 files, 4 hashed (3.05 MB at 9.1 MB/s), 2.3 s"
    assert normalize(a, cwd) == normalize(b, cwd)
    assert normalize(a, cwd) != normalize(a.replace("15 files", "16 files"), cwd)
    row = "PASS  disk          "
    assert normalize(row + "37.05 GB free, need 1 GB", cwd) == normalize(row + "2 GB free", cwd)


def test_re_recording_keeps_a_cut_listing_cut() -> None:
    new = ["a1", "b1", "c", "d", "e1"]
    assert keep_cut(["a", "...", "e"], new) == ["a1", "...", "e1"]
    assert keep_cut(["a", "b", "..."], new) == ["a1", "b1", "..."]
    assert keep_cut(["a", "e"], new) == new  # nothing was cut
    assert keep_cut(["a", "...", "b", "...", "e"], new) == new  # two cuts: which lines to keep is not known
    assert keep_cut(["a", "b", "...", "d", "e"], ["x", "y"]) == ["x", "y"]  # shorter than the cut


def test_readme_fits_on_a_page() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size < README_LIMIT, f"README.md is {size:,} bytes; the reference belongs in docs/"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file."""
    text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.DOTALL)
    out: set[str] = set()
    for heading in re.findall(r"^#+\s+(.*?)\s*$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n, base = 0, slug
        while slug in out:
            n += 1
            slug = f"{base}-{n}"
        out.add(slug)
    return out


def test_relative_links_resolve() -> None:
    """Every relative link of README.md and docs/ names a file of the repository (and a heading of
    it, when the link has a #fragment into Markdown)."""
    bad = []
    for path in PAGES:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            file, _, fragment = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.is_relative_to(ROOT) or not dest.exists():
                bad.append(f"{_page_id(path)}: ({target}): no such file")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                bad.append(f"{_page_id(path)}: ({target}): no such heading")
    assert not bad, "links to nothing in the repository:\n" + "\n".join(bad)


def test_docs_index_lists_every_page() -> None:
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    for path in sorted((ROOT / "docs").glob("*.md")):
        if path.name != "index.md":
            assert f"({path.name})" in index, f"docs/index.md does not link {path.name}"


# -- recording ---------------------------------------------------------------------------------


def keep_cut(shown: list[str], output: list[str]) -> list[str]:
    """The new ``output`` of a re-recorded command, cut where its shown lines were cut: shown as
    head, one ``...``, tail, it keeps as many first and last lines of the new output (a page
    shows what matters of a long listing; re-recording must not paste the whole listing in)."""
    cuts = [i for i, x in enumerate(shown) if x.strip() == "..."]
    if len(cuts) != 1:
        return output
    head, tail = cuts[0], len(shown) - cuts[0] - 1
    if head + tail >= len(output):
        return output
    return output[:head] + ["..."] + (output[len(output) - tail:] if tail else [])


def _record(path: Path, write: bool) -> int:
    """Run a page where its output was recorded, print what each command printed; with ``write``,
    replace the output of every command whose shown lines no longer match (others keep their cuts)."""
    page = parse(path)
    cwd = RECORD_ROOT / path.stem.lower()
    scratch = RECORD_ROOT / f".{path.stem.lower()}-scratch"
    for sub in ("cache", "hf-home", "ms-cache"):
        shutil.rmtree(scratch / sub, ignore_errors=True)
    k3_full = None
    if any(b.k3_full for b in page.blocks):  # made once, kept beside the pages for the next recording
        k3_full = RECORD_ROOT / f".k3-full-{SYNTH_DIGEST}"
        if not (k3_full / "config.json").exists():
            subprocess.run(["k3ckpt", "synth", str(k3_full), "--preset", "k3-full", "--headers-only", "--force"],
                           check=True, env=_env(scratch, {}), stdout=subprocess.DEVNULL)
    by_block: dict[int, list[Result]] = {}
    failed = 0
    for res in run_page(page, scratch, cwd, k3_full=k3_full):
        by_block.setdefault(res.block.line, []).append(res)
        failed += bool(res.problems(cwd))
        print(f"$ {res.command.text}\n" + "\n".join(res.output) + (f"\n[exit {res.rc}]" if res.rc else ""))
    lines = path.read_text(encoding="utf-8").splitlines()
    replace: dict[int, tuple[int, list[str]]] = {}  # first body index -> (closing fence index, body)
    for block in page.blocks:
        results = by_block.get(block.line, [])
        if not any(r.problems(cwd) or (r.output and not r.command.output) for r in results):
            continue
        body: list[str] = []
        for r in results:
            body += ("$ " + r.command.text).split("\n")
            ok = r.command.output and not missing_lines(r.command.output, r.output, cwd)
            body += r.command.output if ok else keep_cut(r.command.output, r.output)
            if r.rc:
                body += ["$ echo $?", str(r.rc)]
        replace[block.line] = (block.end, body)
    if write and replace:
        out: list[str] = []
        i = 0
        while i < len(lines):
            if i in replace:
                i, body = replace[i]
                out += body
            out.append(lines[i])
            i += 1
        path.write_text("\n".join(out) + "\n", encoding="utf-8")
        print(f"rewrote {len(replace)} block(s) of {path}", file=sys.stderr)
    return 1 if failed and not write else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    write = "--write" in args
    sys.exit(max(_record(Path(a).resolve(), write) for a in args if a != "--write"))

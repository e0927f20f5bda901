"""The docs' commands, run as written: every fenced bash or python block in README.md and docs/
is either run here, a page's blocks in order in one scratch directory as a user would run them,
or marked on its page as not run in CI, with the reason.

A block's mark is an HTML comment (invisible on the rendered page) on the line before its fence:

    <!-- ci: run -->                        run by test_a_page_runs_as_written
    <!-- ci: run; expect "TEXT" "TEXT" -->  ... and each TEXT must appear in what it printed
    <!-- ci: run; write FILE -->            the page says to save the block as FILE: it is
                                            written there (and compiled), for later blocks
    <!-- ci: not run: REASON -->            a TPU, a download, hours of compute, ...

The scratch directory links the checkout's read-only parts (configs/, tests/, scripts/, ...,
.venv), so relative paths work and every file a command writes lands in the scratch directory,
never in the checkout; /tmp/ in a command is moved into it too (and TMPDIR points there). A
bash block's exports reach the page's later blocks, as in one shell. `make setup` is left out
of a block (CI's `make test` has just run it). A command's failure, a traceback, or an
expected text missing fails the page's test, naming the page, the block's line and the tail
of its output.

The commands compile at XLA's optimisation level 0 (conftest.FAST_COMPILE, also added to any
XLA_FLAGS a block sets): the pages' pulses are compile-bound, and what they print does not
depend on it.
"""

import glob
import os
import re
import shlex
import subprocess

import pytest

from conftest import FAST_COMPILE, ROOT, USER_XLA_FLAGS

MARK = re.compile(r"<!--\s*ci:\s*(run(?:;\s*write\s+(?P<write>\S+))?"
                  r"(?:;\s*expect\s+(?P<expect>.*?))?|not run:\s*(?P<why>.+?))\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
LANGS = ("bash", "python")
# What a scratch directory links from the checkout: what the pages' commands read.
LINKED = ("configs", "tests", "scripts", "notebooks", "benchmarks", "tools", "tpu", "jaxrl",
          ".venv", "Makefile", "pyproject.toml", "README.md", "docs")
BLOCK_TIMEOUT_S = 900
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")  # the reader's, after `make setup`


def pages() -> list[str]:
  return ["README.md"] + sorted(
      os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                  recursive=True))


def blocks(page: str, text: str | None = None) -> list[dict]:
  """The page's fenced bash and python blocks: {page, line (of the fence), lang, code, mark
  ("run", "not run" or None), expect (texts), write (a file name or ""), why}."""
  if text is None:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
      text = f.read()
  lines, out, i = text.splitlines(), [], 0
  while i < len(lines):
    m = FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
    if m.group(1) in LANGS:
      prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
      mark = MARK.search(prev)
      out.append({
          "page": page, "line": i + 1, "lang": m.group(1), "code": "\n".join(lines[i + 1:end]),
          "mark": None if mark is None else "not run" if mark.group("why") else "run",
          "expect": shlex.split(mark.group("expect") or "") if mark else [],
          "write": (mark.group("write") or "") if mark else "",
          "why": (mark.group("why") or "").strip() if mark else ""})
    i = end + 1
  return out


def scratch_dir(tmp) -> str:
  """A directory that reads like the checkout (its read-only parts linked) and keeps what the
  commands write."""
  for name in LINKED:
    if os.path.exists(os.path.join(ROOT, name)):
      os.symlink(os.path.join(ROOT, name), os.path.join(tmp, name))
  os.makedirs(os.path.join(tmp, "tmp"), exist_ok=True)
  return str(tmp)


def run_block(block: dict, cwd: str, timeout: float = BLOCK_TIMEOUT_S) -> tuple[bool, str]:
  """(passed, output) of one block run in `cwd` as the page writes it (scratch paths moved)."""
  code = block["code"].replace("/tmp/", f"{cwd}/tmp/").replace("make setup && ", "")
  code = re.sub(r"XLA_FLAGS=(\S+)", rf'XLA_FLAGS="\1 {FAST_COMPILE}"', code)
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "PYTEST_CURRENT_TEST")}
  # TMPDIR too: a config that defaults to a scratch path (gsm8k_qwen3's /tmp/gsm8k) finds it.
  env.update(PATH=f"{ROOT}/.venv/bin:{env.get('PATH', '')}", TMPDIR=f"{cwd}/tmp",
             MPLBACKEND="Agg")
  env["XLA_FLAGS"] = f"{USER_XLA_FLAGS} {FAST_COMPILE}".strip()
  if block["write"]:
    with open(os.path.join(cwd, block["write"]), "w", encoding="utf-8") as f:
      f.write(code + "\n")
    cmd = [PYTHON, "-m", "py_compile", block["write"]]
  elif block["lang"] == "python":
    cmd = [PYTHON, "-c", code]
  else:  # what a block exports reaches the page's later blocks, as in the reader's shell
    exports = os.path.join(cwd, ".doc-test-exports")
    cmd = ["bash", "-e", "-o", "pipefail", "-c",
           f"[ -f {exports} ] && source {exports}\n{code}\nexport -p > {exports}"]
  try:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout)
  except subprocess.TimeoutExpired as e:
    return False, f"timed out after {timeout:.0f} s\n{e.stdout or ''}{e.stderr or ''}"
  output = res.stdout + res.stderr
  missing = [t for t in block["expect"] if t not in output]
  ok = res.returncode == 0 and "Traceback (most recent call last)" not in output and not missing
  if missing:
    output += f"\n[doc test] expected and not printed: {missing}"
  return ok, output


def _where(b: dict) -> str:
  return f"{b['page']}:{b['line']}"


ALL = [b for p in pages() for b in blocks(p)]
RUN_PAGES = sorted({b["page"] for b in ALL if b["mark"] == "run"})


def test_every_doc_block_is_run_or_says_why_not(record_property):
  unmarked = [_where(b) for b in ALL if b["mark"] is None]
  assert not unmarked, (
      f"{len(unmarked)} fenced bash/python blocks have no mark: put <!-- ci: run --> or "
      f"<!-- ci: not run: REASON --> on the line before each fence: {unmarked}")
  assert all(b["why"] for b in ALL if b["mark"] == "not run")
  run = sum(b["mark"] == "run" for b in ALL)
  record_property("doc blocks", f"{len(ALL)} blocks, {run} run in CI, {len(ALL) - run} not")


def test_a_broken_command_on_a_page_fails_its_test(tmp_path):
  page = ("Intro.\n\n<!-- ci: run; expect \"runs/sft\" -->\n```bash\n"
          "jaxrl sft --config configs/sft_tiny.py:runlocl --workdir runs/sft\n```\n")
  (b,) = blocks("broken.md", page)
  assert (b["mark"], b["line"], b["expect"]) == ("run", 4, ["runs/sft"])
  ok, output = run_block(b, scratch_dir(tmp_path), timeout=300)
  assert not ok and "runlocl" in output  # the config refuses the misspelt arg in one sentence
  assert not os.path.exists(os.path.join(ROOT, "runs", "sft", "runlocl"))


@pytest.mark.parametrize("page", RUN_PAGES)
def test_a_page_runs_as_written(page, tmp_path):
  cwd = scratch_dir(tmp_path)
  for b in (x for x in ALL if x["page"] == page and x["mark"] == "run"):
    ok, output = run_block(b, cwd)
    assert ok, f"{_where(b)}: the {b['lang']} block failed:\n{output[-4000:]}"

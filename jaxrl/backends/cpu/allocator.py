"""TCMalloc under jaxrl's processes on Linux: found on the machine, preloaded by one re-exec.

Why it matters on CPU: XLA:CPU gives each call of a compiled program one block for all of its
temporaries (615 MB for the peer-anchor learner's forward + backward). glibc serves a block
that size with a fresh mmap from the calling thread's arena and unmaps it when the call ends,
so every update faults in ~172,000 zeroed 4 KiB pages. TCMalloc keeps the block for the next
call. Measured on the anchor (benchmarks/grpo_step.py, 2-core CPU VM, two interleaved A/Bs of
three runs each): steps of 1.21-1.30 s against 1.39-1.51 on glibc, and 1.35-1.38 against
1.44-1.48 an hour later (update 0.62-0.72 against 0.75-0.79); decoding unchanged. glibc's own
knobs do not get there: one arena with mmap off removes the faults but slows decoding ~10% on
the arena lock, and big blocks from a thread's own arena are always mmapped.

    jaxrl ...                       # re-executes itself once with LD_PRELOAD=<libtcmalloc>
    JAXRL_TCMALLOC=0 jaxrl ...      # stay on glibc malloc
    JAXRL_TCMALLOC=/path/libtcmalloc.so jaxrl ...   # a library outside the usual folders

`make` installs Debian's libtcmalloc-minimal4 when it runs as root (tools/setup.sh); elsewhere
`sudo apt-get install libtcmalloc-minimal4` (or google-perftools' tcmalloc of any distro).
A process that already has a tcmalloc loaded (a notebook kernel started with one) is left as
it is. Only the console script and the benchmarks re-exec; importing jaxrl never does.
`python -m jaxrl.backends.cpu.allocator CMD ...` runs any command the same way (`make test` runs
pytest so).
"""

from __future__ import annotations

import glob
import os
import sys

from jaxrl.errors import ConfigError

ENV = "JAXRL_TCMALLOC"
_TRIED = "_JAXRL_TCMALLOC_TRIED"  # set in the re-exec'd process: never loop
_OFF = ("0", "off", "false", "no")
_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so",
          "libtcmalloc.so")
_DIRS = ("/usr/lib/*-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
INSTALL = "apt-get install libtcmalloc-minimal4"


def loaded() -> str | None:
  """The path of a tcmalloc mapped into this process, or None."""
  try:
    with open("/proc/self/maps") as f:
      for line in f:
        if "libtcmalloc" in line:
          return line.split()[-1]
  except OSError:
    pass
  return None


def _turned_off() -> bool:
  return os.environ.get(ENV, "").strip().lower() in _OFF


def find() -> str | None:
  """The library to preload: $JAXRL_TCMALLOC when it names a file, else the first of the usual
  names in the usual folders; None when turned off or not installed."""
  if _turned_off():
    return None
  value = os.environ.get(ENV, "").strip()
  if value:
    if not os.path.isfile(value):
      raise ConfigError(f"{ENV}={value!r} is not a file: set it to a libtcmalloc .so, or to 0 "
                        "to run on glibc malloc.")
    return value
  for name in _NAMES:
    for d in _DIRS:
      hits = sorted(glob.glob(os.path.join(d, name)))
      if hits:
        return hits[0]
  return None


def describe() -> str:
  """One line for banners: which allocator this process runs on, and why."""
  path = loaded()
  if path:
    return f"tcmalloc ({path})"
  if _turned_off():
    return f"glibc malloc ({ENV}=0)"
  if os.environ.get(_TRIED):
    return f"glibc malloc (preloading {os.environ.get('LD_PRELOAD', '?')} did not take)"
  return f"glibc malloc (no libtcmalloc found: {INSTALL})"


def preload_env(lib: str) -> dict[str, str]:
  """os.environ with `lib` first in LD_PRELOAD (and gperftools' large-allocation report off)."""
  env = dict(os.environ)
  env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
  # gperftools prints a warning with a stack trace for every allocation over 1 GiB by default;
  # checkpoints of real models allocate that routinely.
  env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
  return env


def _to_preload() -> str | None:
  """The library a Linux process without tcmalloc should preload, or None. find() runs first,
  so a bad JAXRL_TCMALLOC is an error even where tcmalloc is already loaded."""
  if not sys.platform.startswith("linux"):
    return None
  lib = find()
  return None if lib is None or loaded() else lib


def ensure() -> None:
  """Re-executes this process once with tcmalloc preloaded, when the platform is Linux, none
  is loaded yet, it was not turned off and one is installed; otherwise returns. Call it first
  thing in a program's main (argv is taken from sys.orig_argv, so `python -m ...`, scripts and
  console scripts all come back as they were started)."""
  lib = _to_preload()
  if lib is None or os.environ.get(_TRIED):
    return
  env = preload_env(lib)
  env[_TRIED] = "1"
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def ensure_or_exit() -> None:
  """ensure(), with a bad JAXRL_TCMALLOC said in one line (exit status 2): the jaxrl
  command's first step (jaxrl.__main__, and `python -m jaxrl.cli`)."""
  try:
    ensure()
  except ConfigError as e:
    print(f"jaxrl: error: {e}", file=sys.stderr)
    raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> None:
  """python -m jaxrl.backends.cpu.allocator CMD [ARG ...]: runs CMD with tcmalloc preloaded
  when ensure() would preload it, else as it is (`make test` runs pytest this way)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv:
    raise SystemExit("usage: python -m jaxrl.backends.cpu.allocator CMD [ARG ...]")
  try:
    lib = _to_preload()
  except ConfigError as e:
    raise SystemExit(f"jaxrl.backends.cpu.allocator: error: {e}") from None
  os.execvpe(argv[0], argv, preload_env(lib) if lib else dict(os.environ))


if __name__ == "__main__":
  main()

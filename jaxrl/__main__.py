"""The `jaxrl` console script (and `python -m jaxrl`): re-executes itself on TCMalloc
(jaxrl.backends.cpu.allocator) before the command line's imports load jax, then runs
jaxrl.cli. Importing jaxrl.cli directly (a notebook, a test) never re-executes."""

import sys

from jaxrl.backends.cpu import allocator


def main() -> None:
  allocator.ensure_or_exit()
  from jaxrl import cli
  cli.main(sys.argv[1:])


if __name__ == "__main__":
  main()

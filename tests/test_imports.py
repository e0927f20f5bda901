"""Imports run one way: every jaxrl module imports only from its own layer or the layers below.

Layers, bottom to top (a module may import its own layer and any layer below it):

  errors      jaxrl.errors: the one exception type and the choice check, importable by all.
  backends    jaxrl.backends (the CPU kernels, dots, allocator). The rest of the package imports
              only its switch, the package jaxrl.backends itself (kernels for the attention seam,
              compile options, describe() for the run record), never a backend's own modules:
              the one exception is the console script's allocator re-exec (BACKEND_INTERNALS_OK).
  models      the model, its presets and its Hugging Face config.json map: pure descriptions.
  parallel    mesh, layouts, placement, weight sync, the memory plan: models laid out on devices.
  config      loads a config file and applies --config.a.b overrides. It sits above parallel
              because its base sections (layout, placement, plan) take their choices from there,
              and below everything that reads a config, so it can never import a trainer.
  services    io (checkpoint and HF tensors into a layout), data, tasks, rewards (checkers and
              reward-model scoring), sampler, train (the shared skeleton), evals (held-out
              metrics and the evaluator), envs (environments and the multi-turn driver over
              the sampler). One layer, not four:
              they are peers that a trainer composes (e.g. rewards' reward model restores with
              train's checkpointer and tokenizes with data's tokenizer).
  objectives  jaxrl.objectives (advantages, losses, preference_losses): pure math over arrays.
  algorithms  the trainers: jaxrl.algorithms (sft, rm, dpo, grpo/, ppo/).
  top         the entry points: cli, demo, launch, plot and the package's public API.

Function-local imports count as much as module-level ones: a lazy import hides an edge from a
reader, not from the graph. So do relative imports and importlib.import_module("jaxrl...") calls.
Peers within a layer may import each other, but no set of modules may import in a circle.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "jaxrl")

LAYERS = ("errors", "backends", "models", "parallel", "config", "services", "objectives",
          "algorithms", "top")

# Module (or package prefix) -> layer. The longest matching prefix decides.
LAYER_OF = {
    "jaxrl": "top",
    "jaxrl.cli": "top", "jaxrl.demo": "top", "jaxrl.launch": "top", "jaxrl.plot": "top",
    "jaxrl.errors": "errors",
    "jaxrl.backends": "backends",
    "jaxrl.models": "models",
    "jaxrl.parallel": "parallel",
    "jaxrl.config": "config",
    "jaxrl.io": "services", "jaxrl.data": "services", "jaxrl.tasks": "services",
    "jaxrl.rewards": "services", "jaxrl.sampler": "services", "jaxrl.train": "services",
    "jaxrl.evals": "services", "jaxrl.envs": "services",
    "jaxrl.objectives": "objectives",
    "jaxrl.algorithms": "algorithms",
}

# The modules outside jaxrl.backends that may import a backend's own modules: the console
# script (jaxrl.__main__, and `python -m jaxrl.cli`) re-executes itself on TCMalloc before
# anything else runs (jaxrl.backends.cpu.allocator).
BACKEND_INTERNALS_OK = ("jaxrl.__main__", "jaxrl.cli")

# Edges against the order that are accepted for now, (importer, imported) -> why. Empty: keep it so.
ALLOWLIST: dict = {}


def _module_name(path: str, root: str = ROOT) -> str:
  rel = os.path.relpath(path, root)[:-len(".py")].replace(os.sep, ".")
  return rel.removesuffix(".__init__")


def _is_package(module: str, root: str = ROOT) -> bool:
  return os.path.isfile(os.path.join(root, *module.split("."), "__init__.py"))


def _exists(module: str, root: str = ROOT) -> bool:
  base = os.path.join(root, *module.split("."))
  return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))


def layer_of(module: str) -> str:
  parts = module.split(".")
  for n in range(len(parts), 0, -1):
    prefix = ".".join(parts[:n])
    if prefix in LAYER_OF:
      return LAYER_OF[prefix]
  raise KeyError(f"{module} has no layer: add it to LAYER_OF in tests/test_imports.py")


def imports_of(module: str, text: str, filename: str,
               root: str = ROOT) -> list[tuple[int, str]]:
  """(line, imported jaxrl module) for every import in `text`, at any depth."""
  package = module if _is_package(module, root) else module.rpartition(".")[0]
  out = []
  for node in ast.walk(ast.parse(text, filename)):
    if isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # from . import x / from ..train import sft
        base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join(base + ([node.module] if node.module else []))
      else:
        base = node.module
      for a in node.names:  # `from jaxrl.algorithms import grpo` imports the module jaxrl.algorithms.grpo
        sub = f"{base}.{a.name}"
        out.append((node.lineno, sub if _exists(sub, root) else base))
    elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
          and isinstance(node.args[0].value, str) and (
              getattr(node.func, "attr", None) == "import_module"
              or getattr(node.func, "id", None) == "__import__")):
      out.append((node.lineno, node.args[0].value))
  return [(line, m) for line, m in out if m == "jaxrl" or m.startswith("jaxrl.")]


def violations(module: str, text: str, where: str, root: str = ROOT,
               allowlist: dict = ALLOWLIST) -> list[str]:
  """One line per import of `module` (source `text`, file `where`) against the order."""
  out = []
  mine = layer_of(module)
  for line, target in imports_of(module, text, where, root):
    theirs = layer_of(target)
    if (module, target) in allowlist:
      continue
    if LAYERS.index(theirs) > LAYERS.index(mine):
      out.append(f"{where}:{line} imports {target}: {mine} ({module}) may not import "
                 f"{theirs}, which sits above it")
    elif (theirs == "backends" and mine != "backends" and target != "jaxrl.backends"
          and module not in BACKEND_INTERNALS_OK):
      out.append(f"{where}:{line} imports {target}: outside jaxrl.backends import only its "
                 f"switch (the package jaxrl.backends), not a backend's own modules")
  return out


def _package_files():
  for dirpath, _, names in os.walk(PACKAGE):
    for name in sorted(names):
      if name.endswith(".py"):
        yield os.path.join(dirpath, name)


def _all_edges():
  for path in _package_files():
    module = _module_name(path)
    with open(path) as f:
      text = f.read()
    yield path, module, text


def test_imports_run_one_way():
  bad = []
  for path, module, text in _all_edges():
    bad += violations(module, text, os.path.relpath(path, ROOT))
  assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_every_module_has_a_layer():
  for _, module, _ in _all_edges():
    layer_of(module)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The import cycles of `graph` (module -> imported modules): its strongly connected
  components of more than one module (Tarjan's algorithm, iterative)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph.get(root, ()))))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      v, it = work[-1]
      w = next(it, None)
      if w is not None:
        if w not in index:
          index[w] = low[w] = len(index)
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(sorted(graph.get(w, ())))))
        elif w in on_stack:
          low[v] = min(low[v], index[w])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        comp = []
        while True:
          w = stack.pop()
          on_stack.discard(w)
          comp.append(w)
          if w == v:
            break
        if len(comp) > 1:
          out.append(sorted(comp))
  return out


def test_no_import_cycles():
  """Peers in one layer may import each other, but not in a circle (function-local imports
  included: a lazy import that closes a circle only moves the failure to run time; imports
  under `if TYPE_CHECKING:` too: a type named from a module above is a layer out of place, as
  GRPO's Parts was in its trainer, which every step function imported to name it)."""
  graph = {}
  for path, module, text in _all_edges():
    graph[module] = {t for _, t in imports_of(module, text, path)
                     if t != module and (module, t) not in ALLOWLIST}
  assert not cycles(graph), f"import cycles: {cycles(graph)}"


def test_the_cycle_check_finds_a_cycle():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert not cycles({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}})


def test_allowlist_has_no_stale_edges():
  """An allowlisted edge that no longer exists is deleted, so the list only shrinks."""
  edges = set()
  for path, module, text in _all_edges():
    edges |= {(module, target) for _, target in imports_of(module, text, path)}
  stale = sorted(set(ALLOWLIST) - edges)
  assert not stale, f"allowlisted edges that no longer exist (delete them): {stale}"


@pytest.mark.parametrize("module, text, want", [
    ("jaxrl.models.fake", "from jaxrl.algorithms import grpo\n", "jaxrl.algorithms.grpo"),
    ("jaxrl.models.fake", "import jaxrl.parallel.layouts\n", "jaxrl.parallel.layouts"),
    # Hidden in a function and relative: still an edge, and still named.
    ("jaxrl.models.fake", "def f():\n  from ..algorithms import sft\n", "jaxrl.algorithms.sft"),
    ("jaxrl.config", "def f():\n  from jaxrl.algorithms.grpo import default_config\n", "jaxrl.algorithms.grpo"),
    ("jaxrl.parallel.fake", "import importlib\nimportlib.import_module('jaxrl.sampler')\n",
     "jaxrl.sampler"),
    ("jaxrl.sampler.fake", "from jaxrl.backends.cpu import dots\n",
     "jaxrl.backends.cpu.dots"),  # the backend, but a module of its own, not the switch
])
def test_the_checker_reports_a_forbidden_import(module, text, want):
  bad = violations(module, text, "fake.py", allowlist={})
  assert len(bad) == 1 and f"imports {want}" in bad[0], bad
  line = text[:text.index(want.split(".")[-1])].count("\n") + 1
  assert bad[0].startswith(f"fake.py:{line} "), bad


def test_the_checker_passes_allowed_imports():
  assert not violations("jaxrl.algorithms.grpo",
                        "from jaxrl.objectives import losses\nfrom jaxrl import errors\n"
                        "from jaxrl.train.state import make_train_step\n", "fake.py")
  assert not violations("jaxrl.train.state", "from jaxrl.backends import compiler_options\n",
                        "fake.py")  # the switch
  assert not violations("jaxrl.__main__", "from jaxrl.backends.cpu import allocator\n",
                        "fake.py")

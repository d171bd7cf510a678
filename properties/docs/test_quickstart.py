"""The package's public surface, and the README's example as written.

``examples/quickstart.py`` is the five lines the README shows.  It runs here
verbatim, with one substitution a CPU needs: ``jax.jit``'s compile-and-run is
replaced by ``jax.export`` for CUDA under ``kernel.lowering_only()``, so every
name, argument and shape in it is checked by tracing and lowering the real
kernel; only the GPU's execution is left out."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import kernel
from kernel import api  # noqa: F401 - imported before jax.jit is replaced below

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


def test_the_public_api_is_importable_from_the_package():
  from kernel import Config, chosen_config, dot_product_attention, lowering_only
  from kernel.tiling import config
  assert dot_product_attention is api.dot_product_attention
  assert chosen_config is api.chosen_config and lowering_only is api.lowering_only
  assert Config is config.Config
  assert set(kernel.__all__) <= set(dir(kernel))
  for name in kernel.__all__:
    assert getattr(kernel, name) is not None
  with pytest.raises(AttributeError, match="no attribute 'dot_product_atention'"):
    kernel.dot_product_atention  # noqa: B018 - a misspelling must not resolve


def test_the_readme_example_is_five_lines():
  lines = [l for l in EXAMPLE.read_text().splitlines() if l.strip()]
  assert len(lines) <= 5, lines


def test_the_readme_example_lowers_for_cuda(monkeypatch):
  real_jit = jax.jit
  exported = []
  tracing = []

  def jit_exporting_for_cuda(fun, **kwargs):
    jitted = real_jit(fun, **kwargs)

    def call(*args):
      if tracing:  # a jit inside the traced function is an ordinary jit
        return jitted(*args)
      tracing.append(fun)
      try:
        exp = jax.export.export(jitted, platforms=["cuda"])(*args)
      finally:
        tracing.pop()
      exported.append(exp)
      return jax.tree_util.tree_unflatten(
          exp.out_tree, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exp.out_avals])
    return call

  monkeypatch.setattr(jax, "jit", jit_exporting_for_cuda)
  namespace = {"__name__": "quickstart"}
  with kernel.lowering_only():
    exec(compile(EXAMPLE.read_text(), str(EXAMPLE), "exec"), namespace)
  assert len(exported) == 1, "the example must call its jitted attention once"
  out = namespace["out"]
  assert (out.shape, out.dtype) == ((2, 1024, 8, 128), jnp.bfloat16)
  assert "mosaic_gpu" in exported[0].mlir_module(), "no Mosaic GPU kernel was lowered"


def test_a_readme_that_shows_the_example_shows_it_verbatim():
  """The README shows examples/quickstart.py as it is tested, not a copy
  that can drift from it."""
  readme = (EXAMPLE.parent.parent / "README.md").read_text()
  assert "from kernel import dot_product_attention" in readme, "the README shows no example"
  assert f"```python\n{EXAMPLE.read_text().strip()}\n```" in readme


@pytest.mark.parametrize("doc", ["README.md", "CONTRIBUTING.md", "docs/contracts.md",
                                 "docs/maintaining.md", "docs/proof.md"])
def test_the_readme_names_only_paths_and_commands_that_exist(doc):
  """Every repository path the README (or CONTRIBUTING.md, or a docs/ page) names in
  backticks exists, and every ``python -m harness <command>`` it shows is
  one the harness has."""
  import contextlib
  import io
  import re
  from harness.__main__ import main as harness_main
  root = EXAMPLE.parent.parent
  readme = (root / doc).read_text()
  tops = ("kernel/", "harness/", "properties/", "examples/", "golden/", "docs/", "ci/", ".ci/")
  paths = {m.split("<")[0].split("::")[0] for m in re.findall(r"`([^`\s]+)`", readme)
           if m.startswith(tops)}
  missing = sorted(p for p in paths
                   if not (any(root.glob(p)) if "*" in p else (root / p).exists()))
  assert paths and not missing, missing
  modules = set(re.findall(r"python -m (harness(?:\.\w+)+)", readme))
  assert not [m for m in modules
              if not (root / (m.replace(".", "/") + ".py")).exists()], modules
  commands = set(re.findall(r"python -m harness (\w+)", readme))
  usage = io.StringIO()
  with contextlib.redirect_stdout(usage):
    harness_main(["--help"])
  known = set(re.findall(r"^  (\w+) ", usage.getvalue(), re.M))
  assert (commands or doc != "README.md") and commands <= known, sorted(commands - known)

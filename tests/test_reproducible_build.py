"""Reproducible compiles: the same GGUF, options and sharpi give the same manifest sha256 (the value a user pins with
--expect-sha256) in fresh processes with an empty compile cache. TVM's VMShapeLower ordered the stores of its
shape functions by address, so every process wrote another model.so (sharpi.codegen.reproducible)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import tvm
from tvm import relax, tirx

from sharpi.codegen.reproducible import relax_build_pipeline
from sharpi.codegen.targets.llvm import make_target
from sharpi.common.manifest import manifest_sha256


def _compile_in_fresh_processes(gguf: Path, root: Path, runs: int = 2) -> list[Path]:
    """`sharpi-compile` in `runs` processes at once, each with its own empty SHARPI_HOME (a cleared cache)."""
    outputs, processes = [], []
    for i in range(runs):
        home, out = root / f"home{i}", root / f"out{i}"
        home.mkdir()
        env = {**os.environ, "SHARPI_HOME": str(home)}
        processes.append(subprocess.Popen([sys.executable, "-m", "sharpi.cli.compile", str(gguf), "--target", "llvm",
                                           "-o", str(out), "--quiet"], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outputs.append(out)
    for process in processes:
        stdout, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stdout + stderr
    return outputs


def test_a_recompile_with_a_cleared_cache_gives_the_same_manifest(tiny_gguf, tmp_path):
    first, second = _compile_in_fresh_processes(tiny_gguf, tmp_path)
    if manifest_sha256(first) != manifest_sha256(second):
        files = [json.loads((out / "manifest.json").read_text())["files"] for out in (first, second)]
        differ = sorted(name for name in set(files[0]) | set(files[1]) if files[0].get(name) != files[1].get(name))
        raise AssertionError(f"two compiles of {tiny_gguf.name} with the same options gave manifests "
                             f"{manifest_sha256(first)} and {manifest_sha256(second)}; files that differ: "
                             f"{', '.join(differ) or 'none (a manifest field differs)'}")


def test_shape_functions_come_out_in_one_canonical_form():
    """Two functions alike but for their own symbolic variable: TVM's VMShapeLower alone writes each one a shape
    function whose ten stores come in an order of the variable's address (so the two differ, and differ from
    process to process); after sharpi's pipeline they share one, its stores in slot order, and it computes the
    same shapes."""
    bb = relax.BlockBuilder()
    for name in ("f", "g"):
        n = tirx.Var("n", "int64")
        x = relax.Var("x", relax.TensorType((n,), "float32"))
        with bb.function(name, [x]):
            with bb.dataflow():
                out = bb.emit_output(relax.Tuple([relax.op.concat([x] * k) for k in range(2, 7)]))
            bb.emit_func_output(out)
    target = make_target(None)
    with target, tvm.transform.PassContext(opt_level=3):
        mod = relax_build_pipeline(target)(bb.get())
    shape_funcs = {gv.name_hint: f for gv, f in mod.functions.items() if gv.name_hint.startswith("shape_func")}
    assert list(shape_funcs) == ["shape_func"]
    func = shape_funcs["shape_func"]
    slots = [int(s.indices[0].value) for s in func.body.seq]
    assert slots == sorted(slots) and len(slots) > 1
    assert func.attrs["global_symbol"] == "shape_func"
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target=target, relax_pipeline=relax_build_pipeline(target)),
                              tvm.cpu())
    for name in ("f", "g"):
        got = vm[name](tvm.runtime.tensor(np.arange(3, dtype=np.float32)))
        assert [tuple(t.shape) for t in got] == [(3 * k,) for k in range(2, 7)]
        np.testing.assert_array_equal(got[1].numpy(), np.tile(np.arange(3, dtype=np.float32), 3))

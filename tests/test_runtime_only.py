"""The runtime needs TVM's runtime library alone (a GPU machine may carry only that: benchmarks/gpu_check.py):
with TVM_USE_RUNTIME_LIB=1, loading and running an artifact never loads libtvm_compiler or imports tvm.relax."""
import json
import os
import subprocess
import sys


SCRIPT = """
import json, sys
import sharpi, tvm
model = sharpi.load(sys.argv[1])
logits = model.score([1, 504, 3458, 282, 4649, 314])
print(json.dumps({"compiler": "tvm_compiler" in tvm.base._LOADED_LIBS,
                  "relax": sorted(m for m in sys.modules if m.startswith("tvm.relax")),
                  "argmax": logits.argmax(-1).tolist()}))
"""


def test_artifact_runs_on_the_tvm_runtime_alone(smollm2_artifact, smollm2):
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(smollm2_artifact)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["compiler"] is False and result["relax"] == []
    expected = smollm2.score([1, 504, 3458, 282, 4649, 314]).argmax(-1).tolist()
    assert result["argmax"] == expected

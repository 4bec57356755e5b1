# Small Relax module: rms_norm -> matmul (symbolic n) -> add bias
from tvm.script import ir as I, relax as R, tirx as T
D, H = 64, 96
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor(("n", 64), "float32"), g: R.Tensor((64,), "float32"),
             w: R.Tensor((64, 96), "float32"), b: R.Tensor((96,), "float32")):
        n = T.int64()
        with R.dataflow():
            h = R.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5)
            y = R.matmul(h, w, out_dtype="float32")
            z = R.add(y, b)
            r = R.add(z, R.const(1.0, "float32"))
            R.output(r)
        return r

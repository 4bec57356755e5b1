"""ONNX export: the project's own Relax-to-ONNX translator (TVM has an ONNX importer, no exporter).

It walks the same high-level Relax module the other targets compile, after the SnapKV pass and before
legalization, binding by binding: every Relax op and every named op of sharpi.common.ops becomes a few standard
ONNX nodes (ops.py holds the translations). The paged KV cache becomes a plain one: graph inputs
`past_key.{l}` / `past_value.{l}` [kv_heads, past, head_dim] and outputs `present_key.{l}` / `present_value.{l}`
[kv_heads, past + n, head_dim] (f32; slot order, so a slot index is a position until SnapKV compacts). Weights
are constants: each `sharpi.dequantize.*` call is evaluated at export time into an f32 initializer (or an f16 one
and a Cast), and so is permute_dims of such a weight (unless the weight is also read untransposed, as a tied
embedding is: then it stays a Transpose node and the weight is stored once), all stored once in
`weights.onnx.data` (ONNX external data), which every graph of the export shares. Each node's doc_string names
the Relax binding it translates.

Graphs (one .onnx file each, default ONNX domain, opset OPSET, IR version IR_VERSION):
  prefill         ids int32 [n], pos int32 [n], past caches  ->  logits f32 [1, vocab] (last token), present caches
  prefill_logits  the same, logits [n, vocab] (every token)
  decode          ids int32 [1], pos int32 [1], past caches  ->  logits [1, vocab], present caches
  prefill_snapkv  (SnapKV on) the Relax functions prefill_snapkv, snapkv_select and snapkv_compact composed as the
                  runtime's session does after a fresh prompt: inputs as prefill plus snapkv_window,
                  snapkv_budget, snapkv_recency and snapkv_sinks (int64 [1]; sharpi-onnx.json records the
                  export's settings; snapkv_sinks is optional, its default the export's setting, 0 unless asked);
                  outputs logits, the present caches after eviction ([kv_heads, budget, head_dim] for every
                  layer without a sliding window; sliding-window layers keep all their slots), snapkv_keep int32
                  [L, kv_heads, budget] (the kept slots, ascending; = positions for a fresh prompt) and
                  snapkv_scores f32 [L, kv_heads, past + n].
                  Pooling, its kernel and the granularity are fixed in the graph. Like the runtime, use it for a
                  prompt longer than the budget and the window; the others take any length.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from ...common import ops
from ...common.errors import CompileError, ConfigError, UnsupportedArchitectureError
from ...common.output_dir import OutputKind
from ...common.quant_layout import LAYOUTS, dequantize_layout
from ...common.version import __version__
from ...frontend.config import ARCHITECTURES as FRONTEND_ARCHITECTURES
from ...ir_passes.named_ops import extern_name
from .ops import RELAX_OPS, named_op, supported_ops

OPSET = 18
IR_VERSION = 8
WEIGHTS_FILE = "weights.onnx.data"
EXPORT_FILE = "sharpi-onnx.json"
EXPORT_FORMAT = "sharpi-onnx"
FORMAT_VERSION = 1
WEIGHT_DTYPES = {"f32": "float32", "f16": "float16"}
# every architecture the frontend builds: the translator knows ops, not architectures (tests/test_onnx_export.py
# checks each family against the numpy reference)
ARCHITECTURES = tuple(FRONTEND_ARCHITECTURES)
FUNCTIONS = ("prefill", "prefill_logits", "decode", "prefill_snapkv")
DEFAULT_FUNCTIONS = ("prefill", "decode")
EXTERNAL_MIN_BYTES = 1024             # smaller initializers stay inside the .onnx file
ALIGN = 4096


def _tensor_proto_types():
    return {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "float64": TensorProto.DOUBLE,
            "int32": TensorProto.INT32, "int64": TensorProto.INT64, "uint32": TensorProto.UINT32,
            "uint16": TensorProto.UINT16, "uint8": TensorProto.UINT8, "int8": TensorProto.INT8,
            "bool": TensorProto.BOOL}


# -- symbolic values the translator passes between bindings (besides ONNX tensor names, str) ------------------
@dataclass(frozen=True)
class WeightRef:
    """Parameter `index` of the function's weight tuple (a TupleGetItem of `params`)."""
    index: int


@dataclass(frozen=True)
class ConstWeight:
    """A weight the export evaluates (a dequantize call, maybe transposed): written as an initializer when an
    ONNX node first uses it. make() returns the array in the stored dtype."""
    name: str
    make: object
    shape: tuple


@dataclass(frozen=True)
class KVCache:
    """The paged pool as plain per-layer caches: ONNX tensor names, [kv_heads, slots, head_dim] each."""
    keys: tuple
    values: tuple

    def with_layer(self, layer: int, key: str, value: str) -> "KVCache":
        keys, values = list(self.keys), list(self.values)
        keys[layer], values[layer] = key, value
        return KVCache(tuple(keys), tuple(values))


@dataclass(frozen=True)
class SelectParams:
    """snapkv_select's params tensor, as the export binds it: budget, recency and sinks are ONNX tensors ([1]),
    the rest is fixed in the graph (pooling needs a static kernel)."""
    budget: str
    recency: str
    pooling: str
    kernel: int
    shared: bool
    sinks: str


@dataclass(frozen=True)
class CompactLayers:
    """snapkv_compact's count tensor, as the export binds it: the layers that are compacted."""
    layers: tuple


class _Marker:
    def __init__(self, what: str):
        self.what = what

    def __repr__(self):
        return self.what


WEIGHTS = _Marker("the weight tuple")
PAGED = _Marker("a page table or slot count of the paged cache (the plain cache has no equivalent)")


# -- the shared weight file -------------------------------------------------------------------------------------
class WeightStore:
    """Writes each weight once into the external-data file; graphs reference it by offset."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self._offset = 0
        self.entries: dict[str, tuple[str, tuple, int, int]] = {}    # name -> (dtype, shape, offset, length)

    def get(self, name: str, make):
        """The entry of weight `name`, writing make() (a numpy array) the first time."""
        if name not in self.entries:
            array = np.ascontiguousarray(make())
            pad = (-self._offset) % ALIGN
            self._file.write(b"\0" * pad)
            self._offset += pad
            self._file.write(array.tobytes())
            self.entries[name] = (str(array.dtype), tuple(array.shape), self._offset, array.nbytes)
            self._offset += array.nbytes
        return self.entries[name]

    @property
    def nbytes(self) -> int:
        return self._offset

    def close(self) -> None:
        self._file.close()


# -- building one graph --------------------------------------------------------------------------------------------
class GraphBuilder:
    """Nodes, initializers, inputs and outputs of one ONNX graph, with unique names and scopes (node names read
    `layer3/attention/MatMul_2` in Netron)."""

    def __init__(self, name: str, store: WeightStore):
        self.name, self.store = name, store
        self.nodes, self.inputs, self.outputs, self.initializers = [], [], [], []
        self._names: set[str] = set()
        self._node_names: set[str] = set()
        self._scope: list[str] = []
        self._consts: dict = {}
        self._weights: dict[str, str] = {}
        self.doc = ""             # the Relax binding being translated: every node's doc_string (Netron shows it)

    def _unique(self, base: str, used: set) -> str:
        name, i = base, 1
        while name in used:
            name, i = f"{base}_{i}", i + 1
        used.add(name)
        return name

    def fresh(self, hint: str) -> str:
        return self._unique("/".join(self._scope + [hint]), self._names)

    @contextmanager
    def scope(self, name: str):
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def op(self, op_type: str, inputs, outputs=1, hint: str | None = None, **attrs):
        """Add a node; returns its output name (a list of them when outputs > 1 or a list of names)."""
        names = [self.fresh(hint or op_type) for _ in range(outputs)] if isinstance(outputs, int) else list(outputs)
        node_name = self._unique("/".join(self._scope + [op_type]), self._node_names)
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=node_name, doc_string=self.doc,
                                           **attrs))
        return names[0] if len(names) == 1 and isinstance(outputs, int) and outputs == 1 else names

    def const(self, array, hint: str = "const") -> str:
        """A small constant initializer, shared by every use of the same value."""
        array = np.asarray(array)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            name = self.fresh(hint)
            self.initializers.append(numpy_helper.from_array(array, name))
            self._consts[key] = name
        return self._consts[key]

    def weight(self, name: str, make) -> str:
        """A weight initializer, in the shared external-data file (inline when it is tiny)."""
        if name in self._weights:
            return self._weights[name]
        dtype, shape, offset, length = self.store.get(name, make)
        if length < EXTERNAL_MIN_BYTES:
            tensor = numpy_helper.from_array(np.asarray(make(), dtype=dtype).reshape(shape), name)
        else:
            tensor = TensorProto()
            tensor.name = name
            tensor.data_type = _tensor_proto_types()[dtype]
            tensor.dims.extend(shape)
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
        self._names.add(name)
        self.initializers.append(tensor)
        self._weights[name] = name
        return name

    def input(self, name: str, dtype: str, shape, default=None, doc: str = "") -> str:
        self._names.add(name)
        info = helper.make_tensor_value_info(name, _tensor_proto_types()[dtype], shape)
        info.doc_string = doc
        self.inputs.append(info)
        if default is not None:
            self.initializers.append(numpy_helper.from_array(np.asarray(default, dtype=dtype), name))
        return name

    def output(self, name: str, value: str, dtype: str, shape, doc: str = "") -> None:
        self.op("Identity", [value], outputs=[name])
        self._names.add(name)
        info = helper.make_tensor_value_info(name, _tensor_proto_types()[dtype], shape)
        info.doc_string = doc
        self.outputs.append(info)

    def model(self, doc: str, metadata: dict):
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializer=self.initializers,
                                  doc_string=doc)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                                  producer_name="sharpi", producer_version=__version__, doc_string=doc)
        helper.set_model_props(model, {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
        return model


# -- the translator -------------------------------------------------------------------------------------------------
class Translator:
    """Translates Relax functions into one GraphBuilder, binding by binding (ops.py has the op table)."""

    def __init__(self, gb: GraphBuilder, weights, weight_dtype: str = "float32"):
        self.gb, self.weights, self.weight_dtype = gb, weights, weight_dtype
        self.env: dict = {}
        self.symbols: dict = {}
        self.cache_state: KVCache | None = None
        self.function = None
        self._memo: dict = {}

    # -- walking ---------------------------------------------------------------------------------------------
    def run(self, func, name: str, bindings: dict):
        """Translate Relax function `func`; bindings give each parameter's value by name. Returns the value of
        the function's result (a tensor name, a list for a tuple, a KVCache for the pool)."""
        self.function, self.env, self.symbols = name, {}, {}
        for param in func.params:
            if param.name not in bindings:
                raise CompileError(f"ONNX export: parameter {param.name!r} of {name} has no ONNX binding.")
            value = bindings[param.name]
            self.env[param] = value
            if isinstance(value, str) and isinstance(param.ty, relax.TensorType):
                for axis, dim in enumerate(param.ty.shape.values):
                    if not _is_int(dim) and _is_var(dim):
                        self.symbols.setdefault(dim, (value, axis))
        body = func.body
        self._untransposed = self._weights_used_untransposed(body)
        for block in body.blocks:
            for binding in block.bindings:
                if type(binding).__name__ != "VarBinding":
                    raise CompileError(f"ONNX export: {name} has a {type(binding).__name__}, which the ONNX "
                                       f"exporter does not translate.")
                self.gb.doc = f"{name}: {binding.var.name} = {_op_label(binding.value)}"
                self.env[binding.var] = self.visit(binding.value, binding.var.ty)
        self.gb.doc = ""
        return self.visit(body.body)

    def _weights_used_untransposed(self, body) -> set:
        """Names of the dequantized weights that some binding uses other than through permute_dims (a tied
        embedding: take() reads it as stored, the LM head transposed). permute_dims of any other dequantized
        weight is evaluated at export time; of these it stays a Transpose node, so the weight is stored once."""

        index, weight_of, plain = {}, {}, set()
        for block in body.blocks:
            for binding in block.bindings:
                value = binding.value
                if isinstance(value, relax.TupleGetItem):
                    index[binding.var] = int(value.index)
                    continue
                name = extern_name(value)
                if name is not None and name.startswith(ops.DEQUANTIZE):
                    first = value.args[1].fields[0]
                    if first in index:
                        weight_of[binding.var] = self.weights.names[index[first]].split(":")[0]
                    continue
                is_transpose = (isinstance(value, relax.Call)
                                and getattr(value.op, "name", "") == "relax.permute_dims")
                args = value.fields if isinstance(value, relax.Tuple) else (
                    value.args if isinstance(value, relax.Call) else [value])
                for arg in args:
                    for a in (arg.fields if isinstance(arg, relax.Tuple) else [arg]):
                        if isinstance(a, relax.Var) and a in weight_of and not is_transpose:
                            plain.add(weight_of[a])
        return plain

    def transposed_weight(self, value):
        """permute_dims of a 2-D dequantized weight, evaluated at export time (None: emit a Transpose node)."""
        if not isinstance(value, ConstWeight) or len(value.shape) != 2 or value.name in self._untransposed:
            return None
        make = value.make
        return self.cached(("transposed", value.name), lambda: ConstWeight(
            f"{value.name}.T", lambda: np.ascontiguousarray(make().T), value.shape[::-1]))

    def visit(self, expr, ty=None):

        if isinstance(expr, relax.Var):
            if expr in self.env:
                return self.env[expr]
            if _is_var(expr) and type(expr.ty).__name__ == "PrimType":
                return self.prim(expr)
            raise CompileError(f"ONNX export: {self.function} uses {expr.name} before binding it.")
        if isinstance(expr, relax.Call):
            op = expr.op
            if isinstance(op, tvm.ir.Op) and op.name == "relax.call_dps_packed":
                extern = str(expr.args[0].global_symbol)
                fn = named_op(extern)
                if fn is None:
                    self._unsupported(extern)
                return fn(self, expr, [self.visit(a) for a in expr.args[1].fields], ty)
            if isinstance(op, tvm.ir.Op):
                fn = RELAX_OPS.get(op.name)
                if fn is None:
                    self._unsupported(op.name)
                return fn(self, expr, ty)
            self._unsupported(f"a call of {op}")
        if isinstance(expr, relax.TupleGetItem):
            base = self.visit(expr.tuple_value)
            if base is WEIGHTS:
                return WeightRef(int(expr.index))
            if isinstance(base, (list, tuple)):
                return base[int(expr.index)]
            raise CompileError(f"ONNX export: {self.function} indexes {base!r}, which is not a tuple.")
        if isinstance(expr, relax.Tuple):
            return [self.visit(f) for f in expr.fields]
        if _is_int(expr):
            return int(expr.value)
        if type(expr).__name__ == "FloatImm":
            return float(expr.value)
        if type(expr).__name__ == "GenericConst":
            return self.gb.const(expr.value.numpy(), "const")
        self._unsupported(type(expr).__name__)

    def _unsupported(self, what: str):
        raise CompileError(f"ONNX export: {self.function} uses {what}, which has no ONNX translation (translated: "
                           f"{', '.join(supported_ops())}).")

    # -- values ------------------------------------------------------------------------------------------------
    def tensor(self, value) -> str:
        """An ONNX tensor name for a value (a weight parameter becomes its initializer)."""
        if isinstance(value, str):
            return value
        if isinstance(value, ConstWeight):
            return self.cached(("weight", value.name), lambda: self._materialize(value))
        if isinstance(value, WeightRef):
            name = self.weights.names[value.index].split(":")[0]
            array = self.weights.array(value.index)
            if array.dtype not in (np.float32, np.float16):
                raise CompileError(f"ONNX export: {self.function} uses weight part "
                                   f"{self.weights.names[value.index]} ({array.dtype}) directly, not through a "
                                   f"dequantize op.")
            return self.gb.weight(name, lambda: array)
        raise CompileError(f"ONNX export: {self.function} uses {value!r} where a tensor is expected.")

    def dequantized(self, qtype: str, parts, shape) -> ConstWeight:
        """The weight a sharpi.dequantize call makes from its parts (numpy, at export time; the kernel tests'
        reference dequantization), in the export's weight dtype."""
        if not all(isinstance(p, WeightRef) for p in parts):
            raise CompileError(f"ONNX export: {self.function} dequantizes a value that is not a weight.")
        indices = [p.index for p in parts]
        name = self.weights.names[indices[0]].split(":")[0]

        def make():
            arrays = {part: self.weights.array(i) for (part, _, _), i in zip(LAYOUTS[qtype], indices)}
            w = dequantize_layout(qtype, arrays)
            if list(w.shape) != list(shape):
                raise CompileError(f"ONNX export: {name} dequantizes to {list(w.shape)}, expected {list(shape)}.")
            return w.astype(self.weight_dtype)
        return self.cached(("dequantize", name), lambda: ConstWeight(name, make, tuple(shape)))

    def _materialize(self, value: ConstWeight) -> str:
        """The initializer of a ConstWeight (f32 as used; f16 stored and Cast to f32)."""
        w = self.gb.weight(value.name, value.make)
        if self.weight_dtype == "float32":
            return w
        return self.gb.op("Cast", [w], to=TensorProto.FLOAT, hint=f"{value.name}.f32")

    def cached(self, key, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def new_cache(self, cache: KVCache) -> KVCache:
        self.cache_state = cache
        return cache

    def expect_cache(self, value, op: str) -> KVCache:
        if not isinstance(value, KVCache):
            raise CompileError(f"ONNX export: {op} in {self.function} reads {value!r}, not the KV cache.")
        return value

    def expect_select_params(self, value) -> SelectParams:
        if not isinstance(value, SelectParams):
            raise CompileError("ONNX export: snapkv_select's params must be bound at export time (pooling needs a "
                               "static kernel).")
        return value

    def expect_compact_layers(self, value) -> tuple:
        if not isinstance(value, CompactLayers):
            raise CompileError("ONNX export: snapkv_compact's counts must be bound at export time.")
        return value.layers

    def onnx_dtype(self, dtype: str) -> int:
        types = _tensor_proto_types()
        if dtype not in types:
            raise CompileError(f"ONNX export: element type {dtype} has no ONNX equivalent here.")
        return types[dtype]

    # -- symbolic shapes (tirx expressions) as int64 [1] tensors -----------------------------------------------
    def prim(self, expr) -> str:
        gb = self.gb
        if _is_int(expr):
            return gb.const(np.array([int(expr.value)], np.int64), "dim")
        if _is_var(expr):
            if expr not in self.symbols:
                raise CompileError(f"ONNX export: {self.function} uses the size {expr.name}, which no input fixes.")
            source = self.symbols[expr]
            if isinstance(source, tuple):
                value, axis = source
                source = gb.op("Shape", [value], start=axis, end=axis + 1, hint=expr.name)
                self.symbols[expr] = source
            return source
        ops = {"Add": "Add", "Sub": "Sub", "Mul": "Mul", "FloorDiv": "Div", "Min": "Min", "Max": "Max"}
        kind = type(expr).__name__
        if kind in ops:
            return gb.op(ops[kind], [self.prim(expr.a), self.prim(expr.b)])
        raise CompileError(f"ONNX export: {self.function} has the size expression {expr}, which the ONNX exporter "
                           f"does not translate.")

    def prim_tensor(self, exprs) -> str:
        """int64 [len(exprs)] from a list of size expressions."""
        if all(_is_int(e) for e in exprs):
            return self.gb.const(np.array([int(e.value) for e in exprs], np.int64), "dims")
        return self.gb.op("Concat", [self.prim(e) for e in exprs], axis=0)

    shape_tensor = prim_tensor

    def scalar(self, value: str) -> str:
        return self.gb.op("Squeeze", [value, self.gb.const(np.array([0], np.int64), "axes")])


def _op_label(expr) -> str:
    """What a binding computes, for node doc strings: the Relax op or the named op."""

    if isinstance(expr, relax.Call):
        return extern_name(expr) or getattr(expr.op, "name", "call")
    return type(expr).__name__


def _is_int(expr) -> bool:
    return type(expr).__name__ == "IntImm"


def _is_var(expr) -> bool:
    return type(expr).__name__ == "Var"


# -- the graphs of an export ----------------------------------------------------------------------------------------
def _cache_inputs(gb: GraphBuilder, cfg, past: str = "past") -> KVCache:
    shape = [cfg.n_kv_heads, past, cfg.head_dim]
    doc = "layer {l}'s cached {what} [kv_heads, slots, head_dim] (RoPE'd keys; empty for a fresh sequence)"
    keys, values = [], []
    for l in range(cfg.n_layers):                 # past_key.0, past_value.0, past_key.1, ...
        keys.append(gb.input(f"past_key.{l}", "float32", shape, doc=doc.format(l=l, what="keys")))
        values.append(gb.input(f"past_value.{l}", "float32", shape, doc=doc.format(l=l, what="values")))
    return KVCache(tuple(keys), tuple(values))


def _token_inputs(gb: GraphBuilder, tokens) -> tuple[str, str]:
    ids = gb.input("ids", "int32", [tokens], doc="token ids")
    pos = gb.input("pos", "int32", [tokens], doc="the tokens' logical positions (RoPE): past length onwards")
    return ids, pos


def _cache_outputs(gb: GraphBuilder, cfg, cache: KVCache, slots) -> None:
    for l in range(cfg.n_layers):
        for what, names in (("key", cache.keys), ("value", cache.values)):
            shape = [cfg.n_kv_heads, slots[l] if isinstance(slots, list) else slots, cfg.head_dim]
            gb.output(f"present_{what}.{l}", names[l], "float32", shape,
                      doc=f"layer {l}'s {what}s after this call: the past_{what}.{l} of the next")


def _plain_graph(mod, fname: str, cfg, weights, store, weight_dtype: str) -> GraphBuilder:
    gb = GraphBuilder(fname, store)
    tokens = 1 if fname == "decode" else "n"
    ids, pos = _token_inputs(gb, tokens)
    cache = _cache_inputs(gb, cfg)
    tr = Translator(gb, weights, weight_dtype)
    logits = tr.run(mod[fname], fname, {"ids": ids, "pos": pos, "pool": cache, "page_table": PAGED,
                                         "kv_lens": PAGED, "params": WEIGHTS})
    rows = "n" if fname == "prefill_logits" else 1
    gb.output("logits", tr.tensor(logits), "float32", [rows, cfg.vocab_size],
              doc="logits of every token" if rows == "n" else "logits of the last token")
    _cache_outputs(gb, cfg, tr.cache_state or cache, f"past + {tokens}")
    return gb


def _snapkv_graph(mod, cfg, weights, store, weight_dtype: str, settings) -> GraphBuilder:
    """prefill_snapkv, then snapkv_select on its scores, then snapkv_compact of its cache, as the runtime's
    session composes them after a fresh prompt longer than the budget. One budget for every layer: the graph's
    select and compact are one op each, so a pyramid allocation is the runtime's alone."""
    if settings.allocation != "uniform":
        raise ConfigError(f"The ONNX export's prefill_snapkv keeps one budget in every layer; SnapKV allocation "
                          f"{settings.allocation!r} is the sharpi runtime's alone (export with uniform).")
    gb = GraphBuilder("prefill_snapkv", store)
    ids, pos = _token_inputs(gb, "n")
    cache = _cache_inputs(gb, cfg)
    window = gb.input("snapkv_window", "int64", [1],
                      doc=f"the last queries that score the prompt (settings: {settings.window})")
    budget = gb.input("snapkv_budget", "int64", [1],
                      doc=f"slots each layer and KV head keeps, < past + n (settings: {settings.budget})")
    recency = gb.input("snapkv_recency", "int64", [1],
                       doc=f"the last positions always kept, < budget (settings: {settings.recency})")
    # optional (an initializer holds the export's setting, 0 unless asked), so callers of the graph as it was
    # before sinks existed still run it unchanged
    sinks = gb.input("snapkv_sinks", "int64", [1], default=[settings.sinks],
                     doc=f"the first positions always kept, recency + sinks < budget; optional, the export's "
                         f"setting when not fed ({settings.sinks})")
    tr = Translator(gb, weights, weight_dtype)
    logits, scores = tr.run(mod["prefill_snapkv"], "prefill_snapkv",
                            {"ids": ids, "pos": pos, "pool": cache, "page_table": PAGED, "kv_lens": PAGED,
                             "params": WEIGHTS, "window": window})
    params = SelectParams(budget, recency, settings.pooling, settings.kernel, settings.granularity == "shared",
                          sinks)
    keep = tr.run(mod["snapkv_select"], "snapkv_select", {"scores": scores, "select_params": params})
    compacted = [l for l in range(cfg.n_layers) if not cfg.is_local(l)]
    cache = tr.run(mod["snapkv_compact"], "snapkv_compact", {"pool": tr.cache_state, "page_table": PAGED,
                                                             "keep": keep, "count": CompactLayers(tuple(compacted))})
    gb.output("logits", tr.tensor(logits), "float32", [1, cfg.vocab_size], doc="logits of the last token")
    _cache_outputs(gb, cfg, cache, ["snapkv_budget" if l in compacted else "past + n" for l in range(cfg.n_layers)])
    gb.output("snapkv_keep", keep, "int32", [cfg.n_layers, cfg.n_kv_heads, "snapkv_budget"],
              doc="per layer and KV head, the kept slots (ascending)")
    gb.output("snapkv_scores", tr.tensor(scores), "float32", [cfg.n_layers, cfg.n_kv_heads, "past + n"],
              doc="per layer and KV head, each slot's score (summed softmax of the last window of queries)")
    return gb


def _signature(model) -> dict:

    def entries(infos):
        out = []
        for info in infos:
            t = info.type.tensor_type
            dims = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
            out.append({"name": info.name, "dtype": helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                        "shape": dims})
        return out
    return {"inputs": entries(model.graph.input), "outputs": entries(model.graph.output)}


def export_module(mod, cfg, weights, directory: Path, *, functions=DEFAULT_FUNCTIONS, snapkv_settings=None,
                  weight_dtype: str = "f32", metadata: dict | None = None, check: bool = True) -> dict:
    """Write `<function>.onnx` for each function and the shared weight file into `directory`; returns
    {function: {"file", "inputs", "outputs"}}. snapkv_settings (SnapKVSettings) is needed for prefill_snapkv."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"ONNX weights must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}.")
    if cfg.is_hybrid:
        raise UnsupportedArchitectureError(f"ONNX export: {cfg.arch}'s Gated DeltaNet layers (a recurrent state "
                                           f"per sequence) have no ONNX translation yet.")
    for fname in functions:
        if fname not in FUNCTIONS:
            raise ConfigError(f"Unknown ONNX function {fname!r}; choose from {', '.join(FUNCTIONS)}.")
        needed = ("prefill_snapkv", "snapkv_select", "snapkv_compact") if fname == "prefill_snapkv" else (fname,)
        missing = [f for f in needed if f not in [gv.name_hint for gv in mod.get_global_vars()]]
        if missing:
            raise ConfigError(f"The module has no {', '.join(missing)} to export (SnapKV off?).")
    directory = Path(directory)
    store = WeightStore(directory / WEIGHTS_FILE)
    signature = {}
    try:
        for fname in functions:
            if fname == "prefill_snapkv":
                gb = _snapkv_graph(mod, cfg, weights, store, WEIGHT_DTYPES[weight_dtype], snapkv_settings)
                extra = {"sharpi.snapkv": snapkv_settings.manifest_dict()}
            else:
                gb = _plain_graph(mod, fname, cfg, weights, store, WEIGHT_DTYPES[weight_dtype])
                extra = {}
            doc = f"sharpi {fname}: exported from the Relax function(s) of the same name; see sharpi-onnx.json"
            model = gb.model(doc, {"sharpi.function": fname, "sharpi.config": cfg.to_dict(), **extra,
                                   **(metadata or {})})
            path = directory / f"{fname}.onnx"
            path.write_bytes(model.SerializeToString())
            signature[fname] = {"file": path.name, **_signature(model)}
    finally:
        store.close()
    if check:
        for entry in signature.values():
            onnx.checker.check_model(str(directory / entry["file"]), full_check=True)
    return signature


def write_export_manifest(directory: Path, signature: dict, **fields) -> None:
    """sharpi-onnx.json, last: the format marker, what was exported, and every file of the export (so that a
    later export into the same folder replaces those and nothing else)."""
    files = sorted(p.name for p in Path(directory).iterdir() if p.is_file())
    manifest = {"format": EXPORT_FORMAT, "format_version": FORMAT_VERSION, "opset": OPSET, "ir_version": IR_VERSION,
                "weights_file": WEIGHTS_FILE, **fields, "functions": signature, "files": files}
    (Path(directory) / EXPORT_FILE).write_text(json.dumps(manifest, indent=1))


def export_files(raw: dict) -> list[str] | None:
    """The files an earlier export's sharpi-onnx.json lists (exports written before the list existed: its graphs,
    the weights and the tokenizer), or None if `raw` is not sharpi's."""
    if raw.get("format") != EXPORT_FORMAT:
        return None
    if isinstance(raw.get("files"), list):
        return list(raw["files"])
    functions = raw.get("functions")
    if not isinstance(functions, dict) or not all(isinstance(f, dict) for f in functions.values()):
        return None
    return [f.get("file") for f in functions.values()] + [raw.get("weights_file"), "tokenizer.json"]


EXPORT = OutputKind("sharpi ONNX export", EXPORT_FILE, export_files)

"""The ONNX export: the Relax module after the IR passes, translated binding by binding to ONNX graphs (export.py:
the translator and the files; ops.py: the mapping of each Relax op and named op to ONNX nodes)."""
from .export import (ARCHITECTURES, DEFAULT_FUNCTIONS, EXPORT, EXPORT_FILE, WEIGHT_DTYPES, WEIGHTS_FILE,
                     export_module, write_export_manifest)

__all__ = ["ARCHITECTURES", "DEFAULT_FUNCTIONS", "EXPORT", "EXPORT_FILE", "WEIGHT_DTYPES", "WEIGHTS_FILE",
           "export_module", "write_export_manifest"]

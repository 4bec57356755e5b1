"""Emitters of the Relax module other than the targets' builds: ONNX graphs (onnx/)."""
